"""The package's layers: each folder imports only from its own and from earlier layers.

The house is drawn in docs/internals.md; this test keeps it true (lazy imports inside
functions count too: a circle hidden in a function is still a circle).
"""

import ast
import importlib
import pathlib

from helpers import isinstance_sites

import lsgd_jax

PACKAGE = pathlib.Path(lsgd_jax.__file__).parent
LAYERS = [  # lowest first; a folder may import from its own layer's other folders? no
    {"_core"},
    {"comm", "schedules"},
    {"hook", "averaging"},
    {"mesh"},
    {"report", "checkpoint"},
    {"step"},
    {"elastic", "planner"},
]
LAYER = {name: k for k, names in enumerate(LAYERS) for name in names}
TOP = {"__init__", "_moved", "demo", "elastic_coordinator"}  # the package's front door


def imported_folders(path: pathlib.Path) -> set[str]:
    """The lsgd_jax folders (or top-level modules) a module imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lsgd_jax"):
            parts = node.module.split(".")
            found |= {parts[1]} if len(parts) > 1 else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("lsgd_jax.")}
    return found


def test_every_folder_has_a_layer():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert folders == set(LAYER), "a new folder needs its place in LAYERS and internals.md"
    assert modules == TOP, "a module at the top: put it in the folder of its concern"


def test_no_folder_imports_a_later_layer_or_a_peer():
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        folder = path.relative_to(PACKAGE).parts[0]
        if folder not in LAYER:
            continue
        for other in imported_folders(path) - {folder}:
            if other not in LAYER or LAYER[other] >= LAYER[folder]:
                wrong.append(f"{path.relative_to(PACKAGE)} imports {other}")
    assert not wrong, "\n".join(sorted(wrong))


def private_reaches(path: pathlib.Path, folder: str) -> list[str]:
    """Where a module reaches into another room's privates: a private module of it
    (``lsgd_jax.mesh._mesh``) or a private name of its package (``from lsgd_jax.mesh
    import _fsdp``). ``_core`` is every room's."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lsgd_jax."):
            parts = node.module.split(".")
            if parts[1] in (folder, "_core"):
                continue
            names = [a.name for a in node.names]
            if any(p.startswith("_") for p in parts[2:]) or any(n.startswith("_") for n in names):
                found.append(f"from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "lsgd_jax" and len(parts) > 2 and parts[1] not in (folder, "_core"):
                    if any(p.startswith("_") for p in parts[2:]):
                        found.append(f"import {a.name}")
    return found


def test_no_room_imports_another_rooms_private_modules():
    """Issue 35: a room uses another through its package (``from lsgd_jax.mesh import
    replicate``); what several rooms share lives in ``_core``. A package lists in
    ``_FOR_OTHER_ROOMS`` the names outside ``__all__`` that other rooms use."""
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        folder = path.relative_to(PACKAGE).parts[0]
        if folder in LAYER:
            wrong += [f"{path.relative_to(PACKAGE)}: {w}" for w in private_reaches(path, folder)]
    assert not wrong, "\n".join(sorted(wrong))
    # every name a room takes from another's package is public or declared for rooms
    for path in PACKAGE.rglob("*.py"):
        folder = path.relative_to(PACKAGE).parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and folder in LAYER):
                continue
            parts = node.module.split(".")
            if parts[0] != "lsgd_jax" or len(parts) != 2 or parts[1] in (folder, "_core"):
                continue
            room = importlib.import_module(node.module)
            allowed = set(room.__all__) | set(getattr(room, "_FOR_OTHER_ROOMS", ()))
            for a in node.names:
                where = f"{path.relative_to(PACKAGE)} takes {node.module}.{a.name}"
                assert a.name in allowed, where


def test_the_private_reach_check_finds_one(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from lsgd_jax.mesh._mesh import replicate\nfrom lsgd_jax.averaging import _outer\n"
        "import lsgd_jax.comm._codec\nfrom lsgd_jax.mesh import replicate\n"
        "from lsgd_jax._core import _fsdp\nfrom lsgd_jax.step._phase import x\n"
    )
    assert private_reaches(probe, "step") == [
        "from lsgd_jax.mesh._mesh import replicate",
        "from lsgd_jax.averaging import _outer",
        "import lsgd_jax.comm._codec",
    ]


def test_the_layers_check_finds_a_circle():
    # the check itself: a lazy import inside a function counts
    source = "def f():\n    from lsgd_jax.step import _step\n"
    probe = PACKAGE.parent / "lsgd_jax_layers_probe.py"
    try:
        probe.write_text(source)
        assert imported_folders(probe) == {"step"}
    finally:
        probe.unlink()


def test_no_module_function_or_class_outgrows_its_room():
    # a module over 500 lines, a function over 60 or a class over 150 (docstrings not
    # counted) usually holds more than one concern
    big = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if len(text.splitlines()) > 500:
            big.append(f"{path.relative_to(PACKAGE)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                    body = body[1:]
                if not body:
                    continue
                size = body[-1].end_lineno - body[0].lineno + 1
                limit = 150 if isinstance(node, ast.ClassDef) else 60
                if size > limit:
                    big.append(f"{path.relative_to(PACKAGE)}: {node.name}, {size} lines")
    assert not big, "\n".join(big)


def test_no_code_outside_comm_tests_for_a_strategys_class():
    # strategies answer what they can do (may_skip, rounds_small_values, alongside, init)
    from lsgd_jax.comm._base import Communication

    def subclasses(cls):
        return {s for c in cls.__subclasses__() for s in {c} | subclasses(c)}

    classes = {c.__name__ for c in subclasses(Communication)}  # every strategy, new ones too
    assert {"Flat", "FiniteOnly", "Compressed", "TwoLevel", "Quantized"} <= classes
    found = isinstance_sites(classes, allowed_folders=("comm",))
    assert not found, found
