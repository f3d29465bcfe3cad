"""Counting calls of module-level functions: which path a test's run took (a batched call or the per-sample ones)."""


def counting(monkeypatch, module, names):
    """Replace each function `names` of `module` (for the test's duration) by one that counts its calls: a dict
    name -> calls so far."""
    counts = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(module, name)

        def counted(*args, _name=name, _real=real, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return counts
