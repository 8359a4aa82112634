"""Files that are not safetensors but are often loaded as if they were, told by their first bytes,
so the error says what the file is and what to do instead of reading its first eight bytes as a
header length."""

from __future__ import annotations

_PICKLE_PROTOCOLS = (b"\x02", b"\x03", b"\x04", b"\x05")


def what_it_is(front: bytes) -> str | None:
    """What a file starting with ``front`` is, when it is a common impostor; None otherwise."""
    head = bytes(front[:64])
    text = head.lstrip().lower()
    if head.startswith(b"PK\x03\x04"):
        return (
            "a zip archive, as torch.save writes (pytorch_model.bin): load it with "
            "torch.load(path, weights_only=True), or convert it to safetensors"
        )
    if head[:1] == b"\x80" and head[1:2] in _PICKLE_PROTOCOLS:
        return (
            "a Python pickle (a legacy torch.save file): load it with torch.load(path, weights_only=True), "
            "or convert it to safetensors"
        )
    if head.startswith(b"GGUF"):
        return "a GGUF file (llama.cpp), not safetensors: load the model's safetensors weights instead"
    if head.startswith(b"version https://git-lfs"):
        return "a Git LFS pointer, not the weights: fetch them (git lfs pull, or huggingface-cli download)"
    if text.startswith((b"<!doctype", b"<html", b"<?xml", b"<head", b"<body")):
        return (
            "an HTML or XML page, not weights: an error or sign-in page was saved in place of the file; "
            "download it again"
        )
    if text.startswith((b"{", b"[")):
        return "a JSON document, not safetensors (an index must be named *.index.json)"
    return None
