"""A tool worker process (colo.grpo.tool_workers), run by its path, not as part of the colo package: a
worker imports neither colo nor torch, so it starts in a fraction of a second.

    python .../colo/grpo/tool_worker_main.py FD

FD is its end of a socket pair. It receives (the trainer's sys.path, the tools cloudpickled), then
answers each (name, arguments) with ("ok", value) or ("error", message), one call at a time, until the
socket closes.
"""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.pop(0)   # this script's directory (colo/grpo) would shadow modules named like its files


def serve(fd: int) -> None:
    import pickle
    from multiprocessing.connection import Connection

    connection = Connection(fd)
    path, blob = connection.recv()
    sys.path[:] = path   # the trainer's, so that the tools' own modules import as there
    tools = pickle.loads(blob)
    while True:
        try:
            name, arguments = connection.recv()
        except EOFError:
            return
        try:
            value = tools[name](**arguments)
            connection.send(("ok", value if isinstance(value, (str, list)) else str(value)))
        except BaseException as e:  # noqa: BLE001 - the model reads it
            connection.send(("error", _described(e)))


def _described(error: BaseException) -> str:
    """The error in words, never an error of its own: a __str__ that raises is the tool's bug, not the
    worker's end (colo.grpo.tools.describe_error's rule, here without importing colo)."""
    name = type(error).__name__
    try:
        text = str(error)
    except BaseException:  # noqa: BLE001
        return name
    return f"{name}: {text}" if text else name


if __name__ == "__main__":
    serve(int(sys.argv[1]))
