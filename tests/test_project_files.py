"""The files a user (or their lawyer) looks for first agree with pyproject.toml: LICENSE and CITATION.cff."""

import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_license_file_is_the_license_pyproject_declares():
    assert PROJECT["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert " ".join(text.split()[:4]) == "Apache License Version 2.0,"
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text


def test_citation_names_the_method_and_this_release():
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert citation["cff-version"] == "1.2.0"
    assert (citation["version"], citation["license"]) == (PROJECT["version"], PROJECT["license"])
    method = citation["preferred-citation"]
    assert method["title"].startswith("M6-10T") and method["url"] == "https://arxiv.org/abs/2110.03888"
    assert all({"family-names", "given-names"} <= author.keys() for author in method["authors"])
