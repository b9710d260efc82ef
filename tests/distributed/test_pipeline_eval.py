"""The pipelined validation (`Pipeline.evaluate`, `PipelineEngine.evaluate`) on two CPU processes (gloo): the loss
through the stages equals the loss of the gathered model in one process (replicated 1F1B, interleaved 1F1B, and 2BW,
whose newest weights are the ones evaluated), a 2BW run evaluated mid-run keeps its update rule, no process builds
the model or gathers weights while evaluating, and the trainer's pipelined val_loss equals the one-process trainer's.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

from hf_p2r import P2RForCausalLM
from hf_p2r.distributed.pipeline import build_pipeline, gather_state_dict, pipeline_model_config
from hf_p2r.models.p2r.modeling_p2r import P2RDecoderLayer
from hf_p2r.training import parse_config, train
from hf_p2r.training.engines.pipeline import PipelineEngine
from hf_p2r.training.metrics import read_metrics

from ..training.helpers import TWO_STAGES, tiny_argv
from . import spawn
from .test_pipeline import ATOL, SEQ, adamw, batches, delayed_reference, last_stage_value, model_of, worst_difference

# The same forward in another order of modules: fp32 on CPU, measured 0 (bitwise) for every case here; a margin for
# another CPU's kernels.
EVAL_TOLERANCE = 1e-6
CASES = [("1f1b", "real"), ("1f1b", "cycle"), ("1f1b", "tied"), ("interleaved_1f1b", "cycle"), ("2bw", "real"),
         ("2bw", "cycle")]  # fmt: skip
TRAINER = dict(
    TWO_STAGES,
    pseudo_steps=2,
    real_steps=2,
    eval_steps=1,
    save_steps=0,
)


@contextlib.contextmanager
def counting_builds():
    """Count what would hold the whole model in this process while inside: a `P2RForCausalLM` or a decoder block
    constructed, the pipeline's weights gathered (`gather_state_dict`, any `gather_object`)."""
    counts = {"model": 0, "block": 0, "gather": 0}
    originals = (P2RForCausalLM.__init__, P2RDecoderLayer.__init__, dist.gather_object, dist.all_gather_object)

    def model_init(self, *args, **kwargs):
        counts["model"] += 1
        originals[0](self, *args, **kwargs)

    def block_init(self, *args, **kwargs):
        counts["block"] += 1
        originals[1](self, *args, **kwargs)

    def gathered(function):
        def call(*args, **kwargs):
            counts["gather"] += 1
            return function(*args, **kwargs)

        return call

    P2RForCausalLM.__init__, P2RDecoderLayer.__init__ = model_init, block_init
    dist.gather_object, dist.all_gather_object = gathered(originals[2]), gathered(originals[3])
    try:
        yield counts
    finally:
        P2RForCausalLM.__init__, P2RDecoderLayer.__init__, dist.gather_object, dist.all_gather_object = originals


def everyone(counts: dict) -> dict:
    """`counts` summed over the processes (a collective)."""
    values = torch.tensor([counts[key] for key in sorted(counts)])
    dist.all_reduce(values)
    return dict(zip(sorted(counts), values.tolist(), strict=True))


def one_process_losses(weights: dict | None, pipeline, data: list[torch.Tensor]) -> list[float] | None:
    """The losses of `data`'s batches on the model of `weights` (gathered on the first process) in one process."""
    if weights is None:
        return None
    config = pipeline_model_config(pipeline)
    if config.tie_word_embeddings:  # the head is gathered under the embeddings' name
        weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    model = P2RForCausalLM(config)
    model.load_state_dict(weights)
    model.eval()
    with torch.no_grad():
        return [model(input_ids=ids, labels=ids).loss.item() for ids in data]


def gathered_other_version(pipeline) -> dict | None:
    """2BW's other weight version (not installed in the modules), gathered on the first process."""
    schedule = pipeline.schedule
    mine = {pipeline.name_of(name): p.detach().clone() for name, p in schedule.versions[1 - schedule.installed].items()}
    parts = [None] * pipeline.size if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    return None if parts is None else {name: t for part in parts for name, t in part.items()}


def pipelined_against_gathered(world: int) -> dict:
    """{schedule/pattern: (largest |pipelined - gathered| loss over the batches, counts of builds and gathers during
    the evaluation, modules back in train mode, [2BW: the loss gap to the other version, the weight difference to the
    delayed-update reference after training on])}."""
    out = {}
    microbatches = 2 * world
    data, held_out = batches(4, microbatches), batches(3, 4)
    for schedule, pattern in CASES:
        pipeline = build_pipeline(
            model_of(pattern), schedule=schedule, num_microbatches=microbatches, seq_len=SEQ, optimizer_factory=adamw
        )
        for ids in data[:2]:
            pipeline.step(ids)
            pipeline.update()  # (2BW has updated inside its step)
        with counting_builds() as counts:
            losses = pipeline.evaluate(held_out)  # 2BW: drains first (its last update applied), then evaluates
        losses = losses if losses is not None else [None] * len(held_out)
        mine = [last_stage_value(None if loss is None else loss.item()) for loss in losses]
        train_mode = all(module.training for module in pipeline.modules)
        expected = one_process_losses(gather_state_dict(pipeline), pipeline, held_out)
        gap = max(abs(a - b) for a, b in zip(mine, expected, strict=True)) if expected else 0.0
        case = [gap, everyone(counts), train_mode]
        if schedule == "2bw":
            other = one_process_losses(gathered_other_version(pipeline), pipeline, held_out)
            case.append(max(abs(a - b) for a, b in zip(mine, other, strict=True)) if other else 0.0)
            for ids in data[2:]:  # training goes on after the evaluation with the same rule
                pipeline.step(ids)
            pipeline.drain()
            reference, _ = delayed_reference(pattern, data, microbatches)
            weights = dict(reference.named_parameters())
            case.append(worst_difference((param, weights[name]) for name, param in pipeline.named_parameters()))
        out[f"{schedule}/{pattern}"] = case
    return out


def trainer_evaluation(folder: str) -> dict:
    """The pipelined trainer (1F1B, delink at step 2, evaluated at every step) with the evaluations counted."""
    evaluate, seen = PipelineEngine.evaluate, []

    def counted(self, blocks, count):
        with counting_builds() as counts:
            value = evaluate(self, blocks, count)
        seen.append(everyone(counts))
        return value

    PipelineEngine.evaluate = counted
    try:
        argv = tiny_argv(f"{folder}/run", **TRAINER)
        assert train(parse_config(argv)) == 0
    finally:
        PipelineEngine.evaluate = evaluate
    return {"argv": argv, "val_loss": val_losses(f"{folder}/run"), "counts": seen}


def val_losses(output_dir: str) -> list[tuple[int, float]]:
    return [(r["step"], r["val_loss"]) for r in read_metrics(f"{output_dir}/metrics.jsonl") if "val_loss" in r]


def two_processes(rank: int, world: int) -> dict:
    folder = spawn.shared_folder()
    return {"direct": pipelined_against_gathered(world), "trainer": trainer_evaluation(folder)}


two = spawn.shared_run(two_processes, 2)


NOTHING = {"model": 0, "block": 0, "gather": 0}


@pytest.mark.parametrize("case", [f"{schedule}/{pattern}" for schedule, pattern in CASES])
def test_the_pipelined_validation_loss_equals_the_gathered_models(two, case):
    gap, counts, train_mode = two["direct"][case][:3]
    assert gap <= EVAL_TOLERANCE
    assert counts == NOTHING  # no model or block built, nothing gathered, on any process
    assert train_mode  # the stages train again afterwards


@pytest.mark.parametrize("pattern", ["real", "cycle"])
def test_2bw_evaluates_its_newest_weights_and_keeps_its_update_rule(two, pattern):
    """The newest version W(updated) is evaluated (the other version's loss differs), and the run evaluated after
    two steps goes on to the one-process delayed-update weights."""
    _, _, _, other_gap, weight_difference = two["direct"][f"2bw/{pattern}"]
    assert other_gap > 1e-4
    assert weight_difference < ATOL


def test_the_trainer_validates_through_the_stages_as_one_process_does(two, tmp_path):
    run = two["trainer"]
    assert len(run["counts"]) == len(run["val_loss"]) == 5  # steps 0..4
    assert all(counts == NOTHING for counts in run["counts"])
    argv = [*run["argv"]]
    for name in ("pipeline_parallel_size", "pipeline_schedule", "num_microbatches"):
        index = argv.index(f"--{name}")
        del argv[index : index + 2]
    output_dir = str(tmp_path / "one-process")
    argv[argv.index("--output_dir") + 1] = output_dir
    assert train(parse_config(argv)) == 0
    one_process = val_losses(output_dir)
    assert [step for step, _ in run["val_loss"]] == [step for step, _ in one_process]
    # Step 0 is the same initialisation: the same blocks through the same weights. Later steps add the training's
    # own pipelined-vs-one-process difference (test_pipeline.py's 1e-5 on losses).
    assert run["val_loss"][0][1] == pytest.approx(one_process[0][1], abs=EVAL_TOLERANCE)
    for (step, value), (_, expected) in zip(run["val_loss"], one_process, strict=True):
        assert value == pytest.approx(expected, abs=1e-5), step
