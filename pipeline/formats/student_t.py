"""``student_t``: 6 code points fitted to a Student-t distribution (SPEC section 3)."""

from __future__ import annotations

import math

import torch

from pipeline.formats.base import State, check_weight
from pipeline.formats.scalar import BLOCK, Scalar6, blocked, subsample, lloyd_max_1d
from pipeline.quant import channel_scale


class StudentT(Scalar6):
    """6 code points fitted to a Student-t distribution, bf16 absmax scale per 128-wide block.

    ``fit`` estimates the Student-t (degrees of freedom and scale, by maximum likelihood over a grid)
    of the block-normalised weights, truncated to [-1, 1] where absmax scaling puts them, then places
    the code points by Lloyd-Max on that fitted density: the weights choose the distribution's shape,
    the distribution (not the sample) chooses the code points.
    """

    name = "student_t"
    label = "student-t"
    block = BLOCK
    qmax = 1.0
    DOF_GRID = (1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.0, 10.0, 15.0, 30.0, 100.0)
    SCALE_GRID = torch.logspace(-2.5, 0.5, 61, dtype=torch.float64)
    MAX_SAMPLES = 2 ** 14       # ample for a two-parameter maximum-likelihood fit

    def fit(self, weight: torch.Tensor, seed: int = 0) -> State:
        check_weight(weight)
        w = blocked(weight.detach(), self.block)
        u = (w / channel_scale(w, self.qmax).float()).reshape(weight.shape[0], -1)[:, :weight.shape[1]]
        u = subsample(u, self.MAX_SAMPLES, seed).double().cpu()   # padding excluded: it is not data; a CPU state
        dof, sigma = self.fit_distribution(u)
        grid = torch.linspace(-1, 1, 4001, dtype=torch.float64, device="cpu")
        density = self.log_density(grid, dof, sigma).exp()
        return {"codepoints": lloyd_max_1d(grid, density),
                "dof": torch.tensor(dof, dtype=torch.float32, device="cpu"),
                "sigma": torch.tensor(sigma, dtype=torch.float32, device="cpu")}

    @staticmethod
    def log_density(x: torch.Tensor, dof: float, sigma: torch.Tensor | float) -> torch.Tensor:
        """Unnormalised Student-t log density."""
        return torch.log1p((x / sigma) ** 2 / dof) * (-(dof + 1) / 2)

    def fit_distribution(self, u: torch.Tensor) -> tuple[float, float]:
        """Maximum-likelihood (dof, sigma) of a Student-t truncated to [-1, 1], over a grid."""
        grid = torch.linspace(-1, 1, 1001, dtype=torch.float64, device="cpu")
        sigma = self.SCALE_GRID[:, None]
        best = (-math.inf, 0.0, 0.0)
        for dof in self.DOF_GRID:
            log_norm = torch.log(torch.trapezoid(self.log_density(grid[None, :], dof, sigma).exp(), grid, dim=1))
            ll = self.log_density(u[None, :], dof, sigma).mean(dim=1) - log_norm
            i = int(torch.argmax(ll))
            if float(ll[i]) > best[0]:
                best = (float(ll[i]), dof, float(self.SCALE_GRID[i]))
        return best[1], best[2]
