"""The typed errors: each kind's place in the hierarchy, its builtin base and ``.param``, that it
pickles, that the modules that raised their own classes raise these, and the server's and the
CLI's tables that turn them into statuses and exit codes."""

import pickle

import numpy as np
import pytest

import localllm
from localllm import errors as E

# kind -> the builtin exception callers may already catch it as
BUILTIN = {
    E.ModelFileError: ValueError, E.GGUFError: ValueError, E.UnsupportedModel: ValueError,
    E.TokenizerError: ValueError, E.TemplateError: ValueError, E.EngineError: ValueError,
    E.BadSetting: ValueError, E.NotEnoughMemory: ValueError, E.EmptyPrompt: ValueError,
    E.ContextFull: ValueError, E.PromptTooLong: ValueError, E.TokenOutOfVocab: ValueError,
    E.KVPoolFull: RuntimeError, E.SequenceError: ValueError, E.GrammarError: ValueError,
    E.ConstraintError: ValueError, E.FetchError: RuntimeError,
}


def test_every_kind_is_listed_and_exported():
    kinds = {getattr(E, n) for n in E.__all__} - {E.LocalLLMError}
    assert kinds == set(BUILTIN)
    for name in E.__all__:
        assert getattr(localllm, name) is getattr(E, name)


@pytest.mark.parametrize("kind", sorted(BUILTIN, key=lambda k: k.__name__))
def test_kind_bases_param_and_pickling(kind):
    if kind is E.GGUFError:
        err = kind("bad count", "tensor_info[0].n_dims", 40)
        assert err.param is None and (err.field, err.offset) == ("tensor_info[0].n_dims", 40)
    else:
        err = kind("it went wrong", param="ctx_size")
        assert err.param == "ctx_size" and str(err) == "it went wrong"
        assert kind("no field").param is None
    assert isinstance(err, E.LocalLLMError) and isinstance(err, BUILTIN[kind])
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is kind and str(back) == str(err) and back.param == err.param
    assert back.__dict__ == err.__dict__


def test_the_pool_error_is_also_a_value_error():
    # Inside the pool it was a RuntimeError; where it reached callers, an EngineError.
    assert issubclass(E.KVPoolFull, RuntimeError) and issubclass(E.KVPoolFull, E.EngineError)
    assert issubclass(E.PromptTooLong, E.ContextFull)


def test_the_old_names_are_the_new_classes():
    from localllm.api import EngineError
    from localllm.formats.fetch import FetchError
    from localllm.formats.gguf import GGUFError
    from localllm.generation.constrain import GrammarError
    from localllm.generation.sampling import ConstraintError
    from localllm.models import ModelError
    from localllm.runtime.kv.blocks import PoolExhausted
    from localllm.text.chat_template import TemplateError
    from localllm.text.tokenizer import TokenizerError
    assert (EngineError, FetchError, GGUFError, GrammarError, ConstraintError, ModelError,
            PoolExhausted, TemplateError, TokenizerError) == (
        E.EngineError, E.FetchError, E.GGUFError, E.GrammarError, E.ConstraintError,
        E.UnsupportedModel, E.KVPoolFull, E.TemplateError, E.TokenizerError)


def test_the_errors_module_imports_nothing_of_ours():
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(E))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and not (node.module or "").startswith("localllm")
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("localllm") for a in node.names)


# ----------------------------------------------------------------------------- raised for real

def test_settings_errors_name_their_setting():
    from localllm.generation.sampling import SamplingParams
    from localllm.runtime.kv.blocks import BlockPool
    from localllm.runtime.placement import parse_gpu_layers
    for field, value in (("temperature", -1.0), ("top_p", 2.0), ("seed", -5),
                         ("top_logprobs", 99), ("stop", [""])):
        with pytest.raises(E.BadSetting) as err:
            SamplingParams(**{field: value}).validate()
        assert err.value.param == field
    with pytest.raises(E.BadSetting) as err:
        parse_gpu_layers("many")
    assert err.value.param == "gpu_layers"
    pool = BlockPool(1, 16)
    pool.allocate()
    with pytest.raises(E.KVPoolFull):
        pool.allocate()


def test_grammar_errors_are_typed():
    from localllm.generation.constrain.schema import compile_schema
    with pytest.raises(E.GrammarError):
        compile_schema({"type": "object", "patternProperties": {"a": {}}})


def test_the_engine_raises_typed_errors(smollm_path):
    m = localllm.load(smollm_path, ctx_size=32, threads=1)
    try:
        with pytest.raises(E.TokenOutOfVocab) as err:
            m.generate([1, m.vocab_size + 3], max_tokens=1)
        assert err.value.param == "prompt" and err.value.token == m.vocab_size + 3
        assert str(err.value) == (f"token id {m.vocab_size + 3} is outside the vocabulary "
                                  f"(0..{m.vocab_size - 1})")
        with pytest.raises(E.PromptTooLong) as err:
            m.generate(list(range(1, 33)), max_tokens=1)
        assert (err.value.param, err.value.n_tokens, err.value.ctx) == ("prompt", 32, 32)
        with pytest.raises(E.EmptyPrompt):
            m.generate([], max_tokens=1)
        with pytest.raises(E.TokenOutOfVocab) as err:
            m.detokenize([-1])
        assert err.value.param == "ids"
        with pytest.raises(E.TokenOutOfVocab) as err:
            m.start("hi", max_tokens=1, logit_bias={m.vocab_size: 1.0})
        assert err.value.param == "logit_bias"
        with pytest.raises(E.BadSetting) as err:
            m.generate("hi", top_p=3.0)
        assert err.value.param == "top_p"
        with m.new_sequence() as seq:
            with pytest.raises(E.TokenOutOfVocab):
                seq.feed([m.vocab_size])
            seq.feed(list(range(1, 31)))
            with pytest.raises(E.ContextFull) as err:
                seq.feed([5, 6, 7])
            assert not isinstance(err.value, E.PromptTooLong)
            with pytest.raises(E.SequenceError):
                seq.trim(99)
        with pytest.raises(E.SequenceError):
            seq.feed([1])
        logits = m.logits([1, 2])
        assert logits.shape == (2, m.vocab_size) and np.isfinite(logits).all()
    finally:
        m.close()


def test_load_settings_errors_name_their_setting(smollm_path):
    for settings, param in (({"ctk": "q9"}, "ctk"), ({"lookup": 99}, "lookup"),
                            ({"gpu_layers": "lots"}, "gpu_layers"),
                            ({"kv_block_size": 24}, "kv_block_size"),
                            ({"kv_pool_mb": 0.01}, "kv_pool_mb")):
        with pytest.raises(E.BadSetting) as err:
            localllm.load(smollm_path, ctx_size=64, threads=1, **settings)
        assert err.value.param == param, settings
    with pytest.raises(E.NotEnoughMemory):
        localllm.load(smollm_path, ctx_size=100_000_000, threads=1)


# ----------------------------------------------------------------------------- the tables

def _server_errors():
    pytest.importorskip("fastapi")
    from localllm.apps.server import errors
    return errors


@pytest.mark.parametrize("err, status, code, param", [
    (E.PromptTooLong("x", param="prompt", n_tokens=2000, ctx=1024), 400,
     "context_length_exceeded", None),
    (E.TokenOutOfVocab("token id 9 is outside", param="logit_bias"), 400, "invalid_value",
     "logit_bias"),
    (E.BadSetting("top_p must be in [0, 1]", param="top_p"), 400, "invalid_value", "top_p"),
    (E.KVPoolFull("the KV cache is full", param="kv_pool_mb"), 400, "invalid_value", None),
    (E.GrammarError("no finite value"), 400, "unsupported_schema", None),
    (E.TemplateError("the template raised: roles must alternate"), 400, "invalid_value", None),
    (E.SequenceError("this sequence has been released"), 400, "invalid_value", None),
])
def test_server_table(err, status, code, param):
    errors = _server_errors()
    a = errors.api_error(err)
    assert (a.status, a.code, a.param) == (status, code, param)
    assert errors.request_error(err).body() == a.body()
    assert errors.api_error(err, "messages").param == "messages"


def test_server_table_messages():
    errors = _server_errors()
    a = errors.api_error(E.PromptTooLong("engine words", n_tokens=2000, ctx=1024), "prompt")
    assert a.message == ("the prompt has 2000 tokens but the context holds 1024; shorten it, "
                         "or restart the server with a larger --ctx-size")
    a = errors.api_error(E.GrammarError("no finite value can satisfy the schema"),
                         "response_format")
    assert a.message == "response_format: no finite value can satisfy the schema"
    plain = errors.request_error(ValueError("first\nsecond"))
    assert (plain.status, plain.code, plain.message) == (400, "invalid_value", "first")
    assert errors.request_error(ZeroDivisionError()).status == 500


@pytest.mark.parametrize("err, code", [
    (E.BadSetting("--threads must be >= 0"), 2),
    (E.GGUFError("not a GGUF file", "magic", 0), 3),
    (E.UnsupportedModel("unsupported architecture 'mamba9'"), 3),
    (E.PromptTooLong("the prompt has 90 tokens"), 4),
    (E.TokenOutOfVocab("token id 5"), 4),
    (E.NotEnoughMemory("not enough memory"), 5),
    (E.KVPoolFull("the KV cache is full"), 5),
    (E.FetchError("could not download"), 6),
    (E.TemplateError("the template raised"), 1),
    (FileNotFoundError(2, "No such file", "/x/y.gguf"), 1),
    (ValueError("no prompt"), 1),
])
def test_cli_table(err, code):
    from localllm.apps import cli
    row = cli.exit_for(err)
    assert row.code == code
    line = row.message(err)
    assert "\n" not in line and line
    if isinstance(err, FileNotFoundError):
        assert line == "no such file: /x/y.gguf"
    assert cli.exit_for(ZeroDivisionError()) is None   # a bug: its traceback shows
