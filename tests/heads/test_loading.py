"""The shared model loader: GGUF conversion cached once, local directories, clear errors for bad paths."""

import pytest
import torch

from heads.loading import load_model, parse_dtype, resolve_source
from tests.tiny_models import SMOLLM2, STORIES260K


def test_the_converted_copy_is_keyed_by_content_not_path(tmp_path):
    from heads.loading import _converted_path

    gguf = resolve_source(str(SMOLLM2))
    elsewhere = tmp_path / "copy"
    elsewhere.mkdir()
    for f in SMOLLM2.iterdir():
        (elsewhere / f.name).symlink_to(f.resolve())
    assert _converted_path(resolve_source(str(elsewhere))) == _converted_path(gguf)  # same files, other path
    (elsewhere / "tokenizer.json").unlink()
    (elsewhere / "tokenizer.json").write_text((SMOLLM2 / "tokenizer.json").read_text() + " ")
    assert _converted_path(resolve_source(str(elsewhere))) != _converted_path(gguf)  # the copy takes it


def test_local_directory_and_dtype():
    model = load_model(str(STORIES260K), dtype="fp64")
    assert model.dtype == torch.float64 and not model.training
    assert resolve_source(str(STORIES260K)).gguf_file is None


def test_bad_sources_name_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="--model"):
        resolve_source(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="neither config.json nor a .gguf"):
        resolve_source(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"\.gguf"):
        resolve_source(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="--dtype"):
        parse_dtype("int3")


def test_a_hub_id_that_does_not_load_is_one_error_naming_the_flag(monkeypatch):
    import transformers

    from heads.loading import load_tokenizer

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.\nCheck your connection.")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", offline)
    for load in (load_tokenizer, load_model):
        with pytest.raises(FileNotFoundError, match=r"--model someorg/no-such-model: not a local file or directory, "
                                                    r"and the Hugging Face Hub did not provide it \(We couldn't"):
            load("someorg/no-such-model")


def test_the_cpu_bf16_decision_can_be_forced(monkeypatch):
    """SPECHEADS_CPU_BF16 runs either CPU kind's decision on any machine: --dtype auto and the dtype line follow it."""
    from heads.loading import describe_dtype, fast_bf16, resolve_dtype

    monkeypatch.setenv("SPECHEADS_CPU_BF16", "native")
    assert fast_bf16("cpu") and resolve_dtype("auto") == torch.bfloat16
    assert "SPECHEADS_CPU_BF16=native" in describe_dtype(torch.bfloat16, "auto")
    monkeypatch.setenv("SPECHEADS_CPU_BF16", "emulated")
    assert not fast_bf16("cpu") and resolve_dtype("auto") == torch.float32
    with pytest.warns(UserWarning, match="neither AVX512-BF16 nor AMX"):
        resolve_dtype("bfloat16")
    monkeypatch.setenv("SPECHEADS_CPU_BF16", "yes")
    with pytest.raises(ValueError, match="SPECHEADS_CPU_BF16='yes': expected one of"):
        fast_bf16("cpu")
    monkeypatch.setenv("SPECHEADS_CPU_BF16", "detect")
    assert resolve_dtype("auto") in (torch.float32, torch.bfloat16)
