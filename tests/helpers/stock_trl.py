"""Stock TRL run inside a pytest worker, and the worker left as it was for the tests it runs next."""
import contextlib
import os


@contextlib.contextmanager
def stock_trl_environment():
    """Stock TRL's colocate engine leaves RANK/LOCAL_RANK/WORLD_SIZE in the environment, so the next TRL
    config in this process makes accelerate start a process group (at MASTER_PORT or 29500, which the
    other pytest worker may hold: a free port here) and place the model on "cpu:N", where every
    parameter is copied (colo.trl then reshares them). Afterwards the environment and accelerate's
    state are as they were."""
    from accelerate.state import AcceleratorState

    from conftest import free_port

    saved = dict(os.environ)
    os.environ["MASTER_PORT"] = str(free_port())
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        AcceleratorState._reset_state(reset_partial_state=True)
