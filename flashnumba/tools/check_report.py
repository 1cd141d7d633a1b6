"""One report of ``python -m flashnumba check``, in this process or in a worker process: a module of its own, since
a worker started by ``spawn`` imports the function it runs by its module's name, which ``__main__`` is not."""

from __future__ import annotations


def one_report(target, dtypes, kwargs):
    """(printed text, JSON data, passed) of :func:`flashnumba.check.check_attention` on ``target`` (an adapter name
    or module:function) for ``dtypes`` (None: the implementation's)."""
    from ..check import adapter, check_attention
    from .environment import environment

    impl = adapter(target)
    report = check_attention(impl, dtypes=dtypes, **kwargs)
    text = str(report) if dtypes is None else f"[{', '.join(dtypes)}] {report}"
    return text, dict(report.to_dict(), dtypes=dtypes or list(impl.dtypes), environment=environment()), report.passed
