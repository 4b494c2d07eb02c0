"""A direct loop over particle pairs for the SVGD direction (tests only)."""

import torch


def loop_direction(params, grads, h, c, tau):
    """``sum_l c k(w_l, w_i) g_l - (tau / m) grad_{w_l} k(w_l, w_i)`` for every particle ``i`` by a
    direct O(m^2) loop, the kernel gradient by autograd."""
    m = params.shape[0]
    out = torch.zeros_like(params)
    for i in range(m):
        acc = torch.zeros_like(params[i])
        for l in range(m):
            wl = params[l].clone().requires_grad_(True)
            kappa = torch.exp(-((wl - params[i]) ** 2).sum() / h)
            (dk,) = torch.autograd.grad(kappa, wl)
            acc = acc + c * kappa.detach() * grads[l] - (tau / m) * dk
        out[i] = acc
    return out
