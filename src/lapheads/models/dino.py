"""DINO (Caron et al. 2021) parts: the projection head, the multi-crop wrapper, the loss, the schedules.

Design choices (the DINO paper's defaults, after facebookresearch/dino ``main_dino.py`` / ``vision_transformer.py``):

* **Head**: a 3-layer MLP (GELU, hidden 2048, bottleneck 256), L2 normalisation, then a weight-normalised linear
  layer to K = 65,536 prototypes whose norm is fixed to 1 (``norm_last_layer``); weights trunc-normal(0.02).
* **Multi-crop wrapper**: crops of the same resolution go through the backbone together (the backbone is a
  ``create_vit`` model with ``num_classes=0`` and ``dynamic_img_size=True``, so any Laplacian spec and any crop size
  work); the CLS outputs of all crops are concatenated and projected once.
* **Loss**: cross-entropy between the sharpened, centred teacher distribution of each global crop and the student
  distribution of every other crop; the centre is an EMA (0.9) of the teacher outputs, averaged over ranks.
* **Schedules** are per-iteration arrays: cosine learning rate with linear warm-up, cosine weight decay
  (0.04 -> 0.4), cosine teacher momentum (0.996 -> 1), linear teacher-temperature warm-up.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["DINOHead", "DINOLoss", "MultiCropWrapper", "cosine_schedule", "update_teacher"]


class DINOHead(nn.Module):
    """Args:
    in_dim: backbone output (CLS) dimension.
    out_dim: number of prototypes K.
    hidden_dim, bottleneck_dim: MLP sizes; nlayers: MLP depth (>= 1).
    norm_last_layer: fix the prototypes' weight norm to 1 (DINO's default for ViTs).
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int = 65536,
        hidden_dim: int = 2048,
        bottleneck_dim: int = 256,
        nlayers: int = 3,
        norm_last_layer: bool = True,
    ) -> None:
        super().__init__()
        if nlayers == 1:
            self.mlp = nn.Linear(in_dim, bottleneck_dim)
        else:
            layers: list[nn.Module] = [nn.Linear(in_dim, hidden_dim), nn.GELU()]
            for _ in range(nlayers - 2):
                layers += [nn.Linear(hidden_dim, hidden_dim), nn.GELU()]
            layers.append(nn.Linear(hidden_dim, bottleneck_dim))
            self.mlp = nn.Sequential(*layers)
        for module in self.mlp.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
        self.last_layer = nn.utils.parametrizations.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        self.last_layer.parametrizations.weight.original0.data.fill_(1.0)
        if norm_last_layer:
            self.last_layer.parametrizations.weight.original0.requires_grad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.normalize(self.mlp(x), dim=-1, p=2)
        return self.last_layer(x)


class MultiCropWrapper(nn.Module):
    """Backbone over crops grouped by resolution, then the head over all CLS outputs at once."""

    def __init__(self, backbone: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, crops: list[torch.Tensor]) -> torch.Tensor:
        sizes = torch.tensor([c.shape[-1] for c in crops])
        ends = torch.cumsum(torch.unique_consecutive(sizes, return_counts=True)[1], 0).tolist()
        outputs, start = [], 0
        for end in ends:  # one backbone pass per run of equal-sized crops
            outputs.append(self.backbone(torch.cat(crops[start:end])))
            start = end
        return self.head(torch.cat(outputs))


class DINOLoss(nn.Module):
    """Args:
    out_dim: prototypes K.
    num_crops: global + local crops per image (the student sees all; the teacher the first 2).
    teacher_temps: per-epoch teacher temperatures (warm-up then constant).
    student_temp: 0.1; center_momentum: 0.9.
    """

    def __init__(
        self,
        out_dim: int,
        num_crops: int,
        teacher_temps: np.ndarray,
        student_temp: float = 0.1,
        center_momentum: float = 0.9,
    ) -> None:
        super().__init__()
        self.student_temp, self.center_momentum, self.num_crops = student_temp, center_momentum, num_crops
        self.teacher_temps = teacher_temps
        self.register_buffer("center", torch.zeros(1, out_dim))  # saved with checkpoints: resume needs it

    def forward(self, student_output: torch.Tensor, teacher_output: torch.Tensor, epoch: int) -> torch.Tensor:
        """student_output: (num_crops * B, K); teacher_output: (2 * B, K), crops stacked crop-major."""
        student = (student_output / self.student_temp).chunk(self.num_crops)
        temp = float(self.teacher_temps[min(epoch, len(self.teacher_temps) - 1)])
        teacher = F.softmax((teacher_output - self.center) / temp, dim=-1).detach().chunk(2)
        total, terms = 0.0, 0
        for t_index, t in enumerate(teacher):
            for s_index, s in enumerate(student):
                if s_index == t_index:  # a crop is not compared with itself
                    continue
                total = total + torch.sum(-t * F.log_softmax(s, dim=-1), dim=-1).mean()
                terms += 1
        self.update_center(teacher_output)
        return total / terms

    @torch.no_grad()
    def update_center(self, teacher_output: torch.Tensor) -> None:
        batch_center = teacher_output.sum(0, keepdim=True)
        count = torch.tensor(float(len(teacher_output)), device=teacher_output.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(batch_center)
            dist.all_reduce(count)
        self.center.mul_(self.center_momentum).add_(batch_center / count, alpha=1 - self.center_momentum)


def cosine_schedule(
    base: float, final: float, epochs: int, iters_per_epoch: int, warmup_epochs: float = 0, start_warmup: float = 0.0
) -> np.ndarray:
    """One value per iteration: linear warm-up from ``start_warmup`` to ``base``, then cosine to ``final``."""
    warmup_iters = int(round(warmup_epochs * iters_per_epoch))
    warmup = np.linspace(start_warmup, base, warmup_iters) if warmup_iters > 0 else np.array([])
    iters = np.arange(max(epochs * iters_per_epoch - warmup_iters, 0))
    cosine = final + 0.5 * (base - final) * (1 + np.cos(np.pi * iters / max(len(iters), 1)))
    return np.concatenate([warmup, cosine])


@torch.no_grad()
def update_teacher(student: nn.Module, teacher: nn.Module, momentum: float) -> None:
    """teacher <- momentum * teacher + (1 - momentum) * student, parameter by parameter."""
    for p_student, p_teacher in zip(student.parameters(), teacher.parameters()):
        p_teacher.mul_(momentum).add_(p_student.detach(), alpha=1 - momentum)


def teacher_temperatures(warmup_temp: float, temp: float, warmup_epochs: int, epochs: int) -> np.ndarray:
    """DINO's per-epoch teacher temperature: linear from ``warmup_temp`` to ``temp``, then constant."""
    return np.concatenate(
        [np.linspace(warmup_temp, temp, warmup_epochs), np.ones(max(epochs - warmup_epochs, 0)) * temp]
    )


def cancel_last_layer_gradients(epoch: int, model: nn.Module, freeze_last_layer: int) -> None:
    """DINO keeps the prototypes fixed during the first ``freeze_last_layer`` epochs."""
    if epoch >= freeze_last_layer:
        return
    for name, p in model.named_parameters():
        if "last_layer" in name:
            p.grad = None
