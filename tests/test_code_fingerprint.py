"""What a user function's code fingerprint follows, and what it must not see.

The oracle is real code: each case writes a module to a temporary folder, imports it, takes the
fingerprint, then writes the changed module and imports it again (as an edit of the file
between two runs would). The false alarms are the same file imported from another folder, in
a fresh process (another hash seed), and after the interpreter specialised its bytecode.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import energy_loader as el
from energy_loader.state.code_fingerprint import changed_parts, code_fingerprint
from energy_loader.state.fingerprint import code_differences

NAMES = ("userfns", "userhelpers")


@pytest.fixture(autouse=True)
def _forget_modules():
    yield
    for name in NAMES:
        sys.modules.pop(name, None)


def _module(folder: Path, source: str, name: str = "userfns") -> Any:
    """``source`` written to ``folder/name.py`` and imported as ``name``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# (before, after, the part the change is named by); each module's ``fn`` is fingerprinted.
CASES = {
    "default": ("def fn(x, a=1):\n    return x + a\n", "def fn(x, a=2):\n    return x + a\n"),
    "keyword default": (
        "def fn(x, *, a=[1, 2]):\n    return x + a[0]\n",
        "def fn(x, *, a=[1, 3]):\n    return x + a[0]\n",
    ),
    "partial value": (
        "import functools\ndef base(x, k):\n    return x * k\n"
        "fn = functools.partial(base, k=2.0)\n",
        "import functools\ndef base(x, k):\n    return x * k\n"
        "fn = functools.partial(base, k=3.0)\n",
    ),
    "instance attribute": (
        "class Scale:\n    def __init__(self, s):\n        self.s = s\n"
        "    def __call__(self, x):\n        return x * self.s\nfn = Scale(2.0)\n",
        "class Scale:\n    def __init__(self, s):\n        self.s = s\n"
        "    def __call__(self, x):\n        return x * self.s\nfn = Scale(3.0)\n",
    ),
    "method __call__ calls": (
        "class Scale:\n    def __call__(self, x):\n        return self.apply(x)\n"
        "    def apply(self, x):\n        return x * 2\nfn = Scale()\n",
        "class Scale:\n    def __call__(self, x):\n        return self.apply(x)\n"
        "    def apply(self, x):\n        return x * 3\nfn = Scale()\n",
    ),
    "helper": (
        "def helper(x):\n    return x + 1\ndef fn(x):\n    return helper(x)\n",
        "def helper(x):\n    return x + 2\ndef fn(x):\n    return helper(x)\n",
    ),
    "plain global": (
        "SCALE = {'a': (1, 2)}\ndef fn(x):\n    return x * SCALE['a'][0]\n",
        "SCALE = {'a': (3, 2)}\ndef fn(x):\n    return x * SCALE['a'][0]\n",
    ),
    "class it builds": (
        "class Box:\n    def get(self, x):\n        return x\n"
        "def fn(x):\n    return Box().get(x)\n",
        "class Box:\n    def get(self, x):\n        return -x\n"
        "def fn(x):\n    return Box().get(x)\n",
    ),
    "wrapped body": (
        "import functools\ndef deco(f):\n    @functools.wraps(f)\n    def inner(x):\n"
        "        return f(x)\n    return inner\n@deco\ndef fn(x):\n    return x + 1\n",
        "import functools\ndef deco(f):\n    @functools.wraps(f)\n    def inner(x):\n"
        "        return f(x)\n    return inner\n@deco\ndef fn(x):\n    return x + 2\n",
    ),
    "closure value": (
        "def make(k):\n    def fn(x):\n        return x + k\n    return fn\nfn = make(1)\n",
        "def make(k):\n    def fn(x):\n        return x + k\n    return fn\nfn = make(2)\n",
    ),
}
NAMED = {
    "default": "userfns.fn defaults",
    "keyword default": "userfns.fn defaults",
    "partial value": "partial(userfns.base) arguments",
    "instance attribute": "userfns.Scale instance",
    "method __call__ calls": "userfns.Scale.apply",
    "helper": "userfns.helper",
    "plain global": "userfns.SCALE",
    "class it builds": "userfns.Box.get",
    "wrapped body": "userfns.fn",
    "closure value": "userfns.make.<locals>.fn closure",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_change_is_found_and_named_and_the_same_file_elsewhere_is_not(case, tmp_path) -> None:
    before, after = CASES[case]
    saved = code_fingerprint(_module(tmp_path / "a", before).fn)
    assert saved.startswith("2:")
    assert code_fingerprint(_module(tmp_path / "copy", before).fn) == saved  # another path
    now = code_fingerprint(_module(tmp_path / "b", after).fn)
    assert now != saved
    assert NAMED[case] in changed_parts(saved, now), (saved, now)


def test_a_helper_of_another_user_module_is_followed_a_library_is_named(tmp_path) -> None:
    uses = "import json\nimport userhelpers\nfrom userhelpers import twice\n"
    uses += "def fn(x):\n    return json.dumps(userhelpers.clean(twice(x)))\n"

    def fingerprint(clean: str, folder: str) -> str:
        _module(
            tmp_path / folder,
            f"def clean(x):\n    return {clean}\n" + "def twice(x):\n    return 2 * x\n",
            "userhelpers",
        )
        return code_fingerprint(_module(tmp_path / folder, uses).fn)

    saved = fingerprint("x", "a")
    assert "json" not in saved and "torch" not in saved  # named in the code, not walked
    assert "userhelpers.clean" in saved and "userhelpers.twice" in saved
    assert changed_parts(saved, fingerprint("x.strip()", "b")) == ["userhelpers.clean"]


_ZEROS, _ONES = torch.zeros(2), torch.ones(3)


def test_what_is_not_plain_data_counts_by_type(tmp_path) -> None:
    source = "import functools\ndef base(x, k):\n    return x\nfn = functools.partial(base, {})\n"
    one = code_fingerprint(_module(tmp_path / "a", source.format("range(3)")).fn)
    other = code_fingerprint(_module(tmp_path / "b", source.format("range(4)")).fn)
    assert one == other
    # A library's object (a tensor) by its type, a library's function by its name.
    assert code_fingerprint(lambda x, t=_ZEROS: x) == code_fingerprint(lambda x, t=_ONES: x)
    assert code_fingerprint(torch.utils.data.default_collate).count("=") == 1


SAME = "S = {'b', 'a', 'c'}\nT = frozenset({1.5, 'x'})\n"
SAME += "def helper(x):\n    return x in {'p', 'q', 'r'}\n"
SAME += "class C:\n    k = {'u': 1, 'v': [2, 3]}\n    def __call__(self, x):\n"
SAME += "        return helper(x) and x in S and T and self.k\nfn = C()\n"


def test_the_value_holds_in_a_fresh_process_and_after_specialisation(tmp_path) -> None:
    here = code_fingerprint(_module(tmp_path / "a", SAME).fn)
    module = sys.modules["userfns"]
    for _ in range(200):  # the interpreter specialises hot bytecode in place
        module.fn("p")
    copy.copy(module.fn)  # (copyreg caches __slotnames__ on the class)
    assert code_fingerprint(module.fn) == here
    _module(tmp_path / "b", SAME)
    # The module alone (it imports nothing of the package): a fresh process in ~50 ms.
    program = textwrap.dedent(f"""
        import importlib.util, sys
        def load(name, path):
            spec = importlib.util.spec_from_file_location(name, path)
            module = sys.modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        walk = load("walk", {str(Path(code_fingerprint.__code__.co_filename))!r})
        print(walk.code_fingerprint(load("userfns", {str(tmp_path / "b" / "userfns.py")!r}).fn))
    """)
    outputs = [
        subprocess.run(
            [sys.executable, "-c", program],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    ]
    assert outputs == [here, here]


def test_cycles_and_deep_chains_end() -> None:
    def a(x: int) -> int:
        return b(x) if x else 0

    def b(x: int) -> int:
        return a(x - 1)

    assert code_fingerprint(a) == code_fingerprint(a)
    assert code_fingerprint(a) != code_fingerprint(b)


def test_an_older_releases_fingerprint_is_not_compared() -> None:
    saved = {"type": "MapDataset", "fn": "m.f", "fn_code": "0a1b2c3d4e5f"}
    now = {"type": "MapDataset", "fn": "m.f", "fn_code": "2:m.f=01234567"}
    assert code_differences(saved, now) == []
    assert len(code_differences({**saved, "fn_code": "2:m.f=76543210"}, now)) == 1


# -- end to end: a save with one module, a restore with the changed one ---------------------


def _pipeline(fn: Any, predicate: Any = None) -> el.SavableDataset:
    source: el.SavableDataset = el.IndexedSource(list(range(40)), shuffle=True, seed=3)
    if predicate is not None:
        source = el.FilterDataset(source, predicate)
    return el.BatchDataset(el.MapDataset(source, fn), batch_size=4)


def _save(loader: Any, steps: int = 2) -> tuple[Any, Any]:
    iterator = iter(loader)
    for _ in range(steps):
        next(iterator)
    return loader.state_dict(), [batch.tolist() for batch in iterator]


def test_a_map_fn_default_warns_naming_it_and_continues(tmp_path) -> None:
    before, after = CASES["default"]
    state, rest = _save(el.SavableDataLoader(_pipeline(_module(tmp_path / "a", before).fn)))
    loader = el.SavableDataLoader(_pipeline(_module(tmp_path / "b", after).fn))
    with pytest.warns(
        el.CodeChangedWarning, match=r"MapDataset\.fn \(changed: userfns\.fn defaults\)"
    ):
        loader.load_state_dict(state)
    assert [[x - 1 for x in batch.tolist()] for batch in loader] == rest  # a=2 from here on


def test_a_filter_predicates_default_refuses_with_refuse(tmp_path) -> None:
    source = "def keep(x, m=2):\n    return x % m == 0\ndef fn(x):\n    return x\n"
    first = _module(tmp_path / "a", source)
    state, _ = _save(el.SavableDataLoader(_pipeline(first.fn, first.keep)))
    second = _module(tmp_path / "b", source.replace("m=2", "m=3"))
    loader = el.SavableDataLoader(_pipeline(second.fn, second.keep), on_code_change="refuse")
    with pytest.raises(
        el.StateMismatchError, match=r"FilterDataset\.predicate \(changed: userfns\.keep defaults\)"
    ):
        loader.load_state_dict(state)
    same = _module(tmp_path / "c", source)  # the unchanged file, imported again: quiet
    with warnings.catch_warnings():
        warnings.simplefilter("error", el.CodeChangedWarning)
        el.SavableDataLoader(
            _pipeline(same.fn, same.keep), on_code_change="refuse"
        ).load_state_dict(state)


DATASET = """
import torch
def collate(batch):
    return torch.stack(batch) + 0
def init(worker):
    pass
class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 24
    def __getitem__(self, i):
        return torch.tensor([i * i])
"""


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (("+ 0", "+ 1"), r"DataLoader\.collate_fn \(changed: userfns\.collate\)"),
        (
            ("pass", "torch.manual_seed(worker)"),
            r"DataLoader\.worker_init_fn \(changed: userfns\.init\)",
        ),
        (("i * i", "i + i"), r"DataLoader\.dataset \(changed: userfns\.Squares\.__getitem__\)"),
    ],
)
def test_a_dropin_names_a_changed_collate_worker_init_or_getitem(tmp_path, edit, named) -> None:
    def loader(folder: str, source: str, **options: Any) -> el.SavableDataLoader:
        m = _module(tmp_path / folder, source)
        return el.SavableDataLoader(
            m.Squares(), batch_size=4, collate_fn=m.collate, worker_init_fn=m.init, **options
        )

    state, rest = _save(loader("a", DATASET))
    assert json.loads(json.dumps(state)) == state
    with warnings.catch_warnings():  # the same code elsewhere: quiet
        warnings.simplefilter("error", el.CodeChangedWarning)
        loader("copy", DATASET).load_state_dict(state)
    changed = DATASET.replace(*edit)
    with pytest.raises(el.StateMismatchError, match=named):
        loader("b", changed, on_code_change="refuse").load_state_dict(state)
    restoring = loader("c", changed)
    with pytest.warns(el.CodeChangedWarning, match=named):
        restoring.load_state_dict(state)  # and the values check does not refuse it
    assert len(list(restoring)) == len(rest)


STREAM = """
import torch
class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(0, 40, 1))
"""


def test_an_iterable_dropin_names_its_datasets_changed_iter(tmp_path) -> None:
    first = _module(tmp_path / "a", STREAM)
    state, _ = _save(el.SavableDataLoader(first.Stream(), batch_size=4))
    second = _module(tmp_path / "b", STREAM.replace("40, 1", "40, 2"))
    loader = el.SavableDataLoader(second.Stream(), batch_size=4, on_code_change="refuse")
    with pytest.raises(el.StateMismatchError, match=r"IterableSource\.dataset \(changed: userfns"):
        loader.load_state_dict(state)
