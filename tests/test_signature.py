"""What help(), Jupyter's Shift-Tab and IDEs show for StreamLoader: its real parameters, every
default a value or a documented word, and the arguments a ShardStream owns still refused."""
from __future__ import annotations

import inspect
import pydoc
import re

import numpy as np
import pytest

import gluon_stream as gs

pytestmark = pytest.mark.mxnet  # these tests use MXNet: warm its engine first

STREAM_OPTIONS = ("transform", "shuffle", "seed", "prefetch", "producers", "on_error", "schema",
                  "stats", "num_parts", "part_index", "kvstore", "shard_sizes", "num_epochs",
                  "memory_budget")


def test_signature_lists_the_real_parameters_with_readable_defaults():
    signature = inspect.signature(gs.StreamLoader)
    params = signature.parameters
    assert list(params)[:2] == ["source", "batch_size"]
    assert set(STREAM_OPTIONS) <= set(params)
    for name, param in params.items():
        if param.default is inspect.Parameter.empty:
            continue
        assert "unset" not in repr(param.default).lower(), name
        assert param.default is None or isinstance(param.default, (bool, int, float, str)), \
            (name, param.default)
    defaults = {n: p.default for n, p in params.items()}
    assert defaults["shuffle"] is False and defaults["seed"] is None
    assert defaults["num_workers"] == 0 and defaults["on_error"] == "raise"
    assert defaults["prefetch"] == "auto" and defaults["producers"] == "auto"
    assert defaults["memory_budget"] is None and defaults["num_parts"] == 1


def test_help_and_shift_tab_show_the_signature():
    text = pydoc.render_doc(gs.StreamLoader, renderer=pydoc.plaintext)
    assert "*args" not in text.split("\n |  ")[1]
    # annotations read as written (Python 3.9 shows them quoted: no eval_str there)
    assert re.search(r"batch_size: '?int'?", text) and re.search(r"shuffle: '?bool'? = False", text)
    assert "<unset>" not in text
    assert str(inspect.signature(gs.StreamLoader)).startswith("(source:")


def test_the_defaults_are_what_the_loader_does():
    """A loader built with every default written out is the loader built without them."""
    def src():
        return gs.FunctionSource(range(2), lambda k: np.arange(6.0) + 10 * k, cache_dir=None)

    defaults = {n: p.default for n, p in inspect.signature(gs.StreamLoader).parameters.items()
                if p.default is not inspect.Parameter.empty}
    with gs.StreamLoader(src(), 4) as plain, gs.StreamLoader(src(), 4, **defaults) as spelled:
        assert [b.asnumpy().tolist() for b in plain] == [b.asnumpy().tolist() for b in spelled]
        assert spelled.stream.prefetch == plain.stream.prefetch
        assert spelled.stream.auto_producers and plain.stream.auto_producers


@pytest.mark.parametrize("name", STREAM_OPTIONS)
def test_a_stream_option_named_next_to_a_shard_stream_is_refused_even_at_its_default(name):
    """Whatever its value: shuffle=False next to a shuffling stream would be silently ignored."""
    default = inspect.signature(gs.StreamLoader).parameters[name].default
    with gs.ShardStream(gs.FunctionSource([0], lambda k: np.arange(4.0), cache_dir=None),
                        shuffle=True, seed=0) as stream:
        with pytest.raises(ValueError, match=f"{name} given to StreamLoader together with a "
                                             "ShardStream"):
            gs.StreamLoader(stream, batch_size=2, **{name: default})
        with gs.StreamLoader(stream, batch_size=2) as loader:
            assert sorted(x for b in loader for x in b.asnumpy().tolist()) == [0, 1, 2, 3]


@pytest.mark.parametrize("cls", [gs.StreamLoader, gs.ShardStream])
def test_the_docs_api_page_shows_values_as_defaults(cls):
    """mkdocstrings (griffe) renders a signature from the source text: every default written
    in ``__init__`` is a literal (a value or a documented word), never a sentinel's name."""
    import ast
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    args = tree.body[0].args
    defaults = args.defaults + [d for d in args.kw_defaults if d is not None]
    assert defaults
    for default in defaults:
        assert isinstance(default, ast.Constant), ast.unparse(default)
