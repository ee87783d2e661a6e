"""notebooks/post_local_sgd.ipynb runs end to end (quick sizes) in its own kernel."""

import pathlib

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "post_local_sgd.ipynb"


def outputs(nb, kind):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if kind(o)]


def test_notebook_runs_quick(tmp_path, monkeypatch):
    nb = nbformat.read(NOTEBOOK, as_version=4)  # a copy in memory; the file is not touched
    monkeypatch.setenv("LSGD_NOTEBOOK_QUICK", "1")  # the kernel inherits the environment
    client = NotebookClient(
        nb,
        kernel_name="python3",  # this interpreter's ipykernel
        timeout=300,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},  # run from this checkout
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    nbformat.write(nb, tmp_path / "executed.ipynb")

    assert not outputs(nb, lambda o: o.output_type == "error")
    text = "".join(o.get("text", "") for o in outputs(nb, lambda o: o.output_type == "stream"))
    assert "lsgd_jax 0.1.0 from a checkout" in text
    assert "8 CPU devices, mesh {'node': 2, 'local': 4}" in text
    assert "48 steps of 128 images, local SGD from step 16" in text
    for run in ("DDP", "post-local SGD, H=4", "post-local SGD, H=16", "hierarchical, H=2/16"):
        assert run in text
    images = outputs(nb, lambda o: "image/png" in o.get("data", {}))
    assert len(images) == 1 and len(images[0]["data"]["image/png"]) > 10_000
