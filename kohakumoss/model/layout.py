"""The packed varlen layout of a batch, built once per batch on the host.

Legend: B samples; sample i has a latent grid (h_i, w_i) and L_i text tokens. Image tokens
of all samples are packed sample-major (row-major inside a sample), text tokens likewise,
and the joint sequence of sample i is ``[img_i ; txt_i]`` (``docs/model.md#packed-layout-and-rope-positions``).
Positions (``docs/model.md#packed-layout-and-rope-positions``): text token j -> (0, j, 0, 0); image cell (y, x) -> (0, L_i,
y - (h_i-1)/2, x - (w_i-1)/2). With token dropping, ``keep[i]`` lists the kept cells of
sample i (row-major indices); each keeps its cell's position.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch


@dataclasses.dataclass
class PackedLayout:
    hw: list[tuple[int, int]]
    text_len: list[int]
    img_len: list[int]  # image tokens per sample (h*w, or the kept count)
    joint_len: list[int]
    cu_img: torch.Tensor  # int32 [B+1]
    cu_txt: torch.Tensor  # int32 [B+1]
    cu_joint: torch.Tensor  # int32 [B+1]
    seg_img: torch.Tensor  # int64 [N_img] sample id per image token
    seg_txt: torch.Tensor  # int64 [N_txt]
    seg_joint: torch.Tensor  # int64 [N_joint]
    img_in_joint: torch.Tensor  # int64 [N_img] joint index of each image token
    txt_in_joint: torch.Tensor  # int64 [N_txt]
    pos_joint: torch.Tensor  # float32 [N_joint, 4]
    pos_txt: torch.Tensor  # float32 [N_txt, 4]

    @property
    def batch(self) -> int:
        return len(self.hw)

    @property
    def n_img(self) -> int:
        return int(sum(self.img_len))

    @property
    def n_txt(self) -> int:
        return int(sum(self.text_len))

    @property
    def n_joint(self) -> int:
        return int(sum(self.joint_len))

    def to(self, device: torch.device | str) -> PackedLayout:
        """The layout on ``device`` (``moved``: queued behind a CUDA device's work)."""
        fields = {f.name: (moved(v, device) if isinstance(v, torch.Tensor) else v)
                  for f in dataclasses.fields(self) for v in [getattr(self, f.name)]}
        return PackedLayout(**fields)


def moved(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``. A host tensor goes to a CUDA device through page-locked memory:
    a copy from pageable memory makes the host wait for the device's queued work (a step's
    whole backward, when the trainer makes the next batch during it)."""
    if torch.device(device).type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _cu(lengths: Sequence[int]) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


def build_layout(hw: Sequence[Sequence[int]], text_len: Sequence[int],
                 keep: Sequence[np.ndarray | None] | None = None) -> PackedLayout:
    hw = [(int(h), int(w)) for h, w in hw]
    text_len = [int(n) for n in text_len]
    if len(hw) != len(text_len):
        raise ValueError(f"{len(hw)} grids but {len(text_len)} text lengths")
    keep = list(keep) if keep is not None else [None] * len(hw)
    pos_j, pos_t, seg_i, seg_t, seg_j, img_j, txt_j, img_len = [], [], [], [], [], [], [], []
    offset = 0
    for i, ((h, w), L) in enumerate(zip(hw, text_len)):
        cells = np.arange(h * w) if keep[i] is None else np.asarray(keep[i], dtype=np.int64)
        n = len(cells)
        y, x = cells // w, cells % w
        img_pos = np.zeros((n, 4), np.float32)
        img_pos[:, 1] = L
        img_pos[:, 2] = y - (h - 1) / 2
        img_pos[:, 3] = x - (w - 1) / 2
        txt_pos = np.zeros((L, 4), np.float32)
        txt_pos[:, 1] = np.arange(L)
        pos_j += [img_pos, txt_pos]
        pos_t.append(txt_pos)
        img_j.append(offset + np.arange(n))
        txt_j.append(offset + n + np.arange(L))
        seg_i.append(np.full(n, i))
        seg_t.append(np.full(L, i))
        seg_j.append(np.full(n + L, i))
        img_len.append(n)
        offset += n + L

    def cat(parts, dtype):
        return torch.from_numpy(np.concatenate(parts).astype(dtype)) if parts else torch.zeros(0)

    joint_len = [a + b for a, b in zip(img_len, text_len)]
    return PackedLayout(
        hw=hw, text_len=text_len, img_len=img_len, joint_len=joint_len,
        cu_img=_cu(img_len), cu_txt=_cu(text_len), cu_joint=_cu(joint_len),
        seg_img=cat(seg_i, np.int64), seg_txt=cat(seg_t, np.int64), seg_joint=cat(seg_j, np.int64),
        img_in_joint=cat(img_j, np.int64), txt_in_joint=cat(txt_j, np.int64),
        pos_joint=cat(pos_j, np.float32).reshape(-1, 4), pos_txt=cat(pos_t, np.float32).reshape(-1, 4))
