"""The notebook (examples/d2l_multi_device.ipynb) in a real Jupyter kernel (issue 68): it runs top to bottom with its
live curves, and a run interrupted in a kernel saves, says where, and leaves the kernel clean for the next run."""

import os
from pathlib import Path

import nbformat
from conftest import needs_fashion_mnist
from jupyter_client.manager import start_new_kernel
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "d2l_multi_device.ipynb"
WAIT_S = 600  # a safety net only: each wait is on the kernel's own message


def kernel_env() -> dict:
    """This checkout's jaxtrain, and JAX's device count left to the notebook's own setup_devices."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    env["PYTHONPATH"] = f"{ROOT}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT)
    return env


@needs_fashion_mnist
def test_the_notebook_runs_top_to_bottom_and_redraws_its_curves(tmp_path, monkeypatch):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = next(c for c in nb.cells if c.cell_type == "code")
    assert "EPOCHS = 10" in params.source  # d2l's, as a reader runs it; here shorter
    params.source = "EPOCHS = 2\nTRAIN_SUBSET = 2048\nTEST_SUBSET = 512"
    for k, v in kernel_env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
    NotebookClient(nb, timeout=WAIT_S, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    runs = [c for c in nb.cells if c.cell_type == "code" and "jt.run(" in c.source]
    assert len(runs) == 3
    for cell in runs:
        text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        assert "epoch 2/2:" in text and "test acc" in text, text[-2000:]
        images = [o for o in cell.outputs if o.output_type == "display_data" and "image/png" in o.data]
        assert len(images) == 1 and images[0].metadata is not None, cell.outputs  # one figure, redrawn in place
    table = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    assert table.count("test acc") == 3, table


def test_the_docs_copy_is_the_example_run_whole():
    """docs/d2l-multi-device.ipynb (tools/notebook-outputs; the site renders it, executing nothing): the example's
    cells, and the outputs of a whole run, its three runs' curves and its table among them."""
    example = nbformat.read(NOTEBOOK, as_version=4)
    copy = nbformat.read(ROOT / "docs" / "d2l-multi-device.ipynb", as_version=4)
    assert [(c.cell_type, c.source) for c in copy.cells] == [(c.cell_type, c.source) for c in example.cells]
    runs = [c for c in copy.cells if c.cell_type == "code" and "jt.run(" in c.source]
    for cell in runs:
        text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        assert "epoch 10/10:" in text and any(o.output_type == "display_data" and "image/png" in o.data
                                              for o in cell.outputs), text[-1000:]
    assert "".join(o.get("text", "") for o in copy.cells[-1].outputs).count("test acc") == 3


class Kernel:
    """A Jupyter kernel and its client: ``run(code, interrupt_on=TEXT)`` executes a cell, interrupting the kernel
    the first time TEXT appears in its output; returns the cell's text and its error (ename, evalue) or None."""

    def __init__(self, cwd: Path):
        self.manager, self.client = start_new_kernel(kernel_name="python3", cwd=str(cwd), env=kernel_env())

    def run(self, code: str, interrupt_on: str | None = None) -> tuple[str, tuple | None]:
        msg_id, text, error = self.client.execute(code), [], None
        while True:
            msg = self.client.get_iopub_msg(timeout=WAIT_S)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                text.append(content["text"])
                if interrupt_on and interrupt_on in content["text"]:
                    self.manager.interrupt_kernel()
                    interrupt_on = None
            elif kind == "error":
                error = (content["ename"], content["evalue"])
            elif kind == "status" and content["execution_state"] == "idle":
                return "".join(text), error

    def close(self):
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


@needs_fashion_mnist
def test_an_interrupted_run_saves_says_where_and_the_next_run_in_the_kernel_is_clean(tmp_path):
    kernel = Kernel(tmp_path)
    try:
        _, error = kernel.run("import threading, multiprocessing\nimport jaxtrain as jt\njt.setup_devices(2)")
        assert error is None, error
        config = ("jt.RunConfig(model='lenet', devices=2, epochs=2, train_subset=4096, test_subset=512, log_every=1, "
                  f"checkpoint_dir={str(tmp_path / 'ck')!r}, out={str(tmp_path / 'o')!r}{{}})")
        said, error = kernel.run(f"jt.run({config.format('')})", interrupt_on="step 1:")  # mid-epoch
        assert error is not None and error[0] == "KeyboardInterrupt", (error, said[-2000:])
        assert f"checkpoint saved in {tmp_path / 'ck'}: continue with resume=True" in said, said[-2000:]
        threads, _ = kernel.run("print(threading.active_count(), len(multiprocessing.active_children()))")
        said, error = kernel.run(f"s = jt.run({config.format(', resume=True')})\nprint('digest', s['params_digest'])")
        assert error is None and "digest " in said, (error, said[-2000:])
        assert "resum" in said.lower(), said[-2000:]
        after, _ = kernel.run("print(threading.active_count(), len(multiprocessing.active_children()))")
        assert after == threads and after.split()[1] == "0", (threads, after)  # nothing left behind by either run
    finally:
        kernel.close()
