"""--override-kv read as llama.cpp's string_parse_kv_override (stricter where it is silent), and
applied to the file's metadata where llama.cpp applies it (model_check.overridden_fields).
test_fidelity.py loads with overrides against stock; test_bad_inputs.py runs the refusals."""

from __future__ import annotations

import pytest
from gguf import GGUFReader

from saem_gguf.default_model import default_model_path
from saem_gguf.errors import GGUFFormatError, SaemError
from saem_gguf.gguf_info import read_model_info
from saem_gguf.kv_overrides import merged, parse_kv_overrides
from saem_gguf.model_check import overridden_fields


@pytest.mark.parametrize("text, items", [
    ("a.b=int:6", (("a.b", 6),)), ("a=int:-3", (("a", -3),)), ("a=float:1e-5", (("a", 1e-5),)),
    ("a=bool:true,b=bool:false", (("a", True), ("b", False))), ("a=str:x y", (("a", "x y"),)),
    ('"a=str:1,2",b=int:0', (("a", "1,2"), ("b", 0))), ('a=str:"x"', (("a", '"x"'),)), ("a=str:", (("a", ""),)),
    ("a=str:k=v:w", (("a", "k=v:w"),)),
])
def test_items_read_as_llama_cpp(text, items):
    assert parse_kv_overrides(text) == items
    assert all(type(v) is type(w) for (_, v), (_, w) in zip(parse_kv_overrides(text), items))


@pytest.mark.parametrize("text", ["", "=int:1", 'a=str:"1,2"', "a", "a=1", "a=int:", "a=int:1.5", "a=int:0x10", "a=float:inf",
                                  "a=bool:1", "a=str:" + "é" * 64, "a=int:" + "9" * 20])
def test_bad_items_are_refused(text):
    with pytest.raises(SaemError):
        if not parse_kv_overrides(text):
            raise SaemError("nothing")


def test_a_key_given_twice_is_refused():
    assert merged((("a", 1), ("b", 2))) == {"a": 1, "b": 2}
    with pytest.raises(SaemError, match="gives a twice"):
        merged((("a", 1), ("a", 2)))


def test_overrides_apply_where_llama_cpp_applies_them():
    reader = GGUFReader(default_model_path())
    fields = overridden_fields(reader.fields, (("qwen3moe.expert_used_count", 2), ("general.name", "x"),
                                               ("unknown.key", 1.5)))
    assert fields["qwen3moe.expert_used_count"].contents() == 2 and fields["general.name"].contents() == "x"
    assert read_model_info(default_model_path(), True, (("qwen3moe.expert_used_count", 2),)).n_expert_used == 2
    with pytest.raises(GGUFFormatError, match="give int:VALUE"):
        overridden_fields(reader.fields, (("qwen3moe.block_count", 2.0),))
    with pytest.raises(GGUFFormatError, match="give bool:VALUE"):
        overridden_fields(reader.fields, (("tokenizer.ggml.add_bos_token", 1),))
    # a per-layer key llama.cpp reads only from the file (get_key_or_arr) where the file lacks it
    absent = "qwen3moe.feed_forward_length"
    without = {k: f for k, f in reader.fields.items() if k != absent}
    with pytest.raises(GGUFFormatError, match="absent from this file"):
        overridden_fields(without, ((absent, 64),))
    assert overridden_fields(reader.fields, ((absent, 64),))[absent].contents() == 64  # a scalar there
