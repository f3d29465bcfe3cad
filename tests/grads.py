"""Gradient bookkeeping for tests."""



def collect_grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def relative_l2(grads, reference):
    """||g - ref|| / ||ref|| over all parameters together; a parameter missing on one side counts as zeros."""
    names = set(grads) | set(reference)
    num = sum(float(((grads.get(n, 0) - reference.get(n, 0)) ** 2).sum()) if n in grads and n in reference
              else float((grads.get(n, reference.get(n)) ** 2).sum()) for n in names)
    den = sum(float((g ** 2).sum()) for g in reference.values())
    return (num / den) ** 0.5


def grads_of(model, fn):
    model.zero_grad(set_to_none=True)
    result = fn()
    return collect_grads(model), result
