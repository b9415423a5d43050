"""Hugging Face model families, one file each; `registry` holds the table of them."""
