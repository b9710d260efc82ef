"""`import hf_p2r` before or after transformers, in every order users write (placeholder: filled in by the lead)."""
