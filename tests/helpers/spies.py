"""Call counters for the tests: which of an engine's entry points a run went through."""


def count_calls(owner, name: str) -> list:
    """Replace `owner.name` by a wrapper that calls it and appends 1 to the returned list at each call
    (for this test's object only: the instance attribute shadows the class's method)."""
    calls = []
    real = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    setattr(owner, name, counted)
    return calls
