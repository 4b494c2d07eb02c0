"""An ensemble of ``m`` copies of one ``torch.nn.Module`` evaluated in a single batched call."""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, stack_module_state, vmap

from gpsd._internal.user_warning import warn

__all__ = ["ParticleEnsemble"]

_SEP = "__"


def _reinitialise(module: nn.Module) -> None:
    """``reset_parameters()`` on every submodule that has one, except frozen ones.

    A submodule whose own parameters all have ``requires_grad=False`` (a frozen, pretrained layer)
    is not reset (its buffers keep their values too); a frozen parameter of a partly frozen one (a
    frozen weight beside a trainable bias) gets its value back after the reset.
    """
    frozen = [(p, p.detach().clone()) for p in module.parameters() if not p.requires_grad]
    for sub in module.modules():
        reset = getattr(sub, "reset_parameters", None)
        own = list(sub.parameters(recurse=False))
        if callable(reset) and not (own and not any(p.requires_grad for p in own)):
            reset()
    with torch.no_grad():
        for p, value in frozen:
            p.copy_(value)


class ParticleEnsemble(nn.Module):
    r"""``m`` particles :math:`\mathbf{w}_1, \dots, \mathbf{w}_m` of one network architecture.

    The parameters of the ``m`` copies are stacked along a leading particle dimension (with
    :func:`torch.func.stack_module_state`) and the copies are evaluated together with
    :func:`torch.func.vmap` over :func:`torch.func.functional_call`:

    .. math::

        \mathbf{Z}_{l} = g_{\mathbf{w}_l}(\mathbf{X}), \qquad l = 1, \dots, m,

    so ``ensemble(x)`` has shape ``(m, *x.shape[:-1], d_out)``. The stacked parameters are ordinary
    :class:`torch.nn.Parameter` objects of shape ``(m, *p.shape)``: any ``torch.optim`` optimiser
    steps all particles at once, and :class:`~gpsd.dpkl.SteinVariationalGradient` rewrites their
    ``.grad`` beforehand.

    :param module: a network (deep-copied ``m`` times, each copy re-initialised by calling
        ``reset_parameters()`` on every submodule that has one when ``m > 1``; a single particle
        keeps the network's values) or a zero-argument callable that
        returns a freshly initialised network (called ``m`` times). Frozen parameters
        (``requires_grad=False``, a pretrained layer, say) stay frozen in the ensemble: they keep
        their values when the copies are re-initialised (a submodule whose own parameters are all
        frozen is not reset at all), and the training loops of the DPKL models neither step them
        nor count them in the particles' distances.
    :param num_particles: the number of particles ``m >= 1``.
    :param reinitialise: when ``module`` is a network, re-initialise the copies (default) or keep
        ``m`` identical copies.

    ``BatchNorm`` in training mode updates every particle's running statistics as the
    stand-alone network would (tested against a loop over the particles). Dropout draws
    different masks for different particles. :meth:`train` and
    :meth:`eval` reach the copies: in evaluation mode dropout is off and ``BatchNorm`` uses its
    running statistics, as in the stand-alone network.

    Example:

        >>> net = lambda: torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(),
        ...                                   torch.nn.Linear(16, 2))
        >>> ensemble = ParticleEnsemble(net, num_particles=10)
        >>> ensemble(torch.randn(7, 5)).shape
        torch.Size([10, 7, 2])
    """

    def __init__(
        self,
        module: nn.Module | Callable[[], nn.Module],
        num_particles: int,
        *,
        reinitialise: bool = True,
    ) -> None:
        super().__init__()
        try:  # any integer type (NumPy's, a 0-d integer tensor), as gpsd's check_int
            if isinstance(num_particles, bool):
                raise TypeError
            count = operator.index(num_particles)
        except TypeError:
            raise TypeError(
                f"num_particles must be an int, got {type(num_particles).__name__}"
            ) from None
        num_particles = count
        if num_particles < 1:
            raise ValueError(f"num_particles must be at least 1, got {num_particles}")
        if isinstance(module, nn.Module):
            copies = [copy.deepcopy(module) for _ in range(num_particles)]
            if reinitialise and num_particles > 1:
                for c in copies:
                    _reinitialise(c)
        elif callable(module):
            copies = [module() for _ in range(num_particles)]
            if not all(isinstance(c, nn.Module) for c in copies):
                raise TypeError("module must be a torch.nn.Module or a callable returning one")
        else:
            raise TypeError(
                f"module must be a torch.nn.Module or a callable returning one, got {type(module)}"
            )
        self.num_particles = num_particles
        params, buffers = stack_module_state(copies)
        if not params and not buffers:  # vmap would fail later with nothing to map over
            raise ValueError(
                "module must have at least one parameter or buffer (m copies of a fixed map "
                f"are one particle), got {type(copies[0]).__name__} with none"
            )
        trainable = {k: p.requires_grad for k, p in copies[0].named_parameters()}
        varied = [v for k, v in params.items() if trainable[k]]
        should_differ = reinitialise or not isinstance(module, nn.Module)
        if num_particles > 1 and should_differ and varied:
            if all(bool((v == v[:1]).all()) for v in varied):
                warn(
                    f"all {num_particles} particles start with identical trainable parameters "
                    "(no submodule has reset_parameters(), or the factory returns the same "
                    "values); Stein repulsion cannot separate identical particles, so the "
                    "ensemble stays one network. Pass a factory that initialises fresh ones.",
                    UserWarning,
                )
        self._param_names = list(params)
        self._buffer_names = list(buffers)
        self.particle_parameters = nn.ParameterDict(
            {
                k.replace(".", _SEP): nn.Parameter(v.detach().clone(), requires_grad=trainable[k])
                for k, v in params.items()
            }
        )
        for k, v in buffers.items():
            self.register_buffer("particle_buffer" + _SEP + k.replace(".", _SEP), v.clone())
        # The architecture, kept on the meta device and outside the module tree so that it holds no
        # memory, is not in state_dict() and does not follow .to().
        skeleton = copy.deepcopy(copies[0]).to("meta")
        object.__setattr__(self, "_skeleton", skeleton)
        skeleton.train(self.training)

    def train(self, mode: bool = True) -> ParticleEnsemble:
        """Set training mode, also on the architecture that evaluates every particle."""
        super().train(mode)
        self._skeleton.train(mode)  # outside the module tree, so nn.Module.train misses it
        return self

    # ------------------------------------------------------------------ parameter access
    def stacked_parameters(self) -> dict[str, Tensor]:
        """The stacked parameters by their name in the base network, each ``(m, *shape)``."""
        return {k: self.particle_parameters[k.replace(".", _SEP)] for k in self._param_names}

    def stacked_buffers(self) -> dict[str, Tensor]:
        """The stacked buffers by their name in the base network, each ``(m, *shape)``."""
        return {
            k: getattr(self, "particle_buffer" + _SEP + k.replace(".", _SEP))
            for k in self._buffer_names
        }

    def flat_parameters(self) -> Tensor:
        """All parameters of each particle flattened into one row: shape ``(m, P)``."""
        return torch.cat(
            [p.reshape(self.num_particles, -1) for p in self.particle_parameters.values()], -1
        )

    def particle_module(self, index: int) -> nn.Module:
        """A stand-alone copy of particle ``index`` (detached parameters), e.g. for inspection."""
        if not -self.num_particles <= index < self.num_particles:
            raise IndexError(f"index must lie in [0, {self.num_particles}), got {index}")
        module = copy.deepcopy(self._skeleton)
        state = {k: v[index].detach().clone() for k, v in self.stacked_parameters().items()}
        state.update({k: v[index].detach().clone() for k, v in self.stacked_buffers().items()})
        # Non-persistent buffers (stacked with the others) are not state_dict() keys of the network:
        # load_state_dict would reject them, so they are assigned directly.
        persistent = set(module.state_dict())
        module.load_state_dict({k: v for k, v in state.items() if k in persistent}, assign=True)
        for name in state.keys() - persistent:
            owner, _, leaf = name.rpartition(".")
            module.get_submodule(owner)._buffers[leaf] = state[name]
        return module

    # ------------------------------------------------------------------ forward
    def _call_one(self, params: dict[str, Tensor], buffers: dict[str, Tensor], x: Tensor) -> Tensor:
        return functional_call(self._skeleton, (params, buffers), (x,))

    @property
    def in_features(self) -> int | None:
        """The input width of the network, where it can be read: the ``in_features`` of its first
        submodule that holds parameters (an ``nn.Linear`` first layer); else ``None``."""
        for module in self._skeleton.modules():
            if next(module.parameters(recurse=False), None) is not None:
                width = getattr(module, "in_features", None)
                return width if isinstance(width, int) else None
        return None

    def forward(self, x: Tensor) -> Tensor:
        """Evaluate every particle on ``x``: returns shape ``(m, *x.shape[:-1], d_out)``.

        Inputs of another width than the network's first layer takes (:attr:`in_features`)
        raise a ``ValueError`` naming both widths.
        """
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        try:
            return vmap(self._call_one, in_dims=(0, 0, None), randomness="different")(
                self.stacked_parameters(), self.stacked_buffers(), x
            )
        except RuntimeError as err:
            expected = self.in_features
            got = x.shape[-1] if x.dim() else None
            if expected is None or got == expected:
                raise
            raise ValueError(
                f"x has {got} input features, but the feature extractor expects {expected} "
                f"(the in_features of its first layer); got x of shape {tuple(x.shape)}"
            ) from err

    def extra_repr(self) -> str:
        return f"num_particles={self.num_particles}, base={self._skeleton.__class__.__name__}"
