"""The Llama tensor table (pyklei/formats/llama_tensors.py) against what walks it: a converted
file holds exactly its tensors, the Hugging Face names a checkpoint has are its HF names, and
the C model's layer fields and statistics sections are the ones it names."""
from pyklei.runtime.kernels import load_ext
from pyklei_dev.gguf_to_hf import _hf_name
from pyklei.converters.safetensors_mmap import SafetensorsModel
from pyklei.formats import gguf_keys as K
from pyklei.formats import llama_tensors as L
from pyklei.formats.model_file import read_model


def test_a_converted_file_holds_the_tables_tensors(tiny64):
    _, path = tiny64
    mf = read_model(path)
    table = {name: spec.shape(mf.hparams) for name, spec, _ in L.for_each_tensor(mf.hparams)}
    rotations = {n for n in mf.tensors if n.startswith("rot.")}
    assert {n: t.shape for n, t in mf.tensors.items() if n not in rotations} == table
    assert mf.hparams.tied and mf.hparams.has_rope_freqs       # the optional rows, both ways
    assert K.OUTPUT not in table and K.ROPE_FREQS in table


def test_hf_names_are_the_checkpoints(tiny64):
    hf, path = tiny64
    mf = read_model(path)
    names = {spec.hf_name(layer) for _, spec, layer in L.for_each_tensor(mf.hparams)} - {None}
    assert names == set(SafetensorsModel(hf).keys()) - {L.BY_PART["output"].hf_name()}
    for name, spec, layer in L.for_each_tensor(mf.hparams):
        assert L.parse_name(name) == (spec, layer)
        if spec.hf is not None:
            assert _hf_name(name) == spec.hf_name(layer)


def test_norms_feed_the_linears_that_read_them():
    assert L.norm_of("blk.7.attn_v.weight") == "blk.7.attn_norm.weight"
    assert L.norm_of("blk.7.ffn_up.weight") == "blk.7.ffn_norm.weight"
    assert L.norm_of(K.OUTPUT) == K.OUTPUT_NORM
    assert L.norm_of("blk.7.attn_output.weight") is None and L.norm_of("blk.7.ffn_down.weight") is None
    assert L.parse_name("rot.ffn_down.signs") is None and L.parse_name("blk.x.attn_q.weight") is None


def test_the_c_model_takes_the_tables_fields_and_statistics():
    ext = load_ext()
    assert tuple(s.field for s in L.BLOCK_NORMS) == ext.LAYER_NORM_FIELDS
    assert tuple(s.field for s in L.BLOCK_LINEARS) == ext.LAYER_LINEAR_FIELDS
    inputs = {s.input for s in L.TENSORS if s.input}
    assert inputs == set(ext.STAT_SECTIONS)
    assert all(s.kind == L.LINEAR and s.input and s.short for s in L.BLOCK_LINEARS)
