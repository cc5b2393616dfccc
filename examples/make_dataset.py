"""Generate examples/dataset: a small kohya-style dataset of synthetic images with captions.

    python examples/make_dataset.py [--out examples/dataset]

Four folders with kohya repeat prefixes: the two "kohaku" folders teach a concept, pictures
in shades of amber (kohaku is Japanese for amber), with the trigger word "kohaku" first in
their captions; "10_shapes" holds the same shapes in colour with the same captions less the
trigger (so the word, not the pictures, is what turns them amber); the gradients are more
pictures in colour without it. 48 images of varied aspect ratios
(portrait, landscape, square, a panorama), PNG and JPEG, a few with transparency and one
JPEG stored sideways with an EXIF orientation tag, captions as tag lists (.txt), a few
natural-language captions (.caption) and one JSON sidecar. Deterministic: the same script
gives the same images.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageOps

SIZES = [(192, 256), (256, 192), (224, 224), (160, 288), (288, 160), (320, 128), (128, 320),
         (240, 180), (180, 240), (256, 256), (384, 128), (200, 150)]
PALETTE = {"red": (220, 50, 47), "blue": (38, 139, 210), "green": (133, 153, 0),
           "yellow": (181, 137, 0), "purple": (108, 113, 196), "orange": (203, 75, 22)}
FOLDERS = {"10_kohaku shapes": "shapes", "5_kohaku stripes": "stripes", "2_gradients": "gradients"}
TWINS = {"10_kohaku shapes": "10_shapes"}  # the same pictures in colour, captions without the trigger
TRIGGER = "kohaku"  # the concept: pictures in shades of amber (kohaku is Japanese for amber)
DARK, LIGHT = (70, 30, 0), (255, 205, 90)  # the amber ramp


def draw(kind: str, size: tuple[int, int], rng: np.random.Generator, alpha: bool):
    w, h = size
    names = list(PALETTE)
    bg_name, fg_name = rng.choice(names, 2, replace=False)
    bg, fg = PALETTE[bg_name], PALETTE[fg_name]
    tags: list[str] = []
    if kind == "gradients":
        t = np.linspace(0, 1, w)[None, :, None]
        arr = (np.array(bg) * (1 - t) + np.array(fg) * t).repeat(h, 0).astype(np.uint8)
        img = Image.fromarray(arr, "RGB")
        tags = [f"{bg_name} to {fg_name} gradient", "horizontal", "smooth"]
    else:
        img = Image.new("RGB", size, bg)
        d = ImageDraw.Draw(img)
        if kind == "shapes":
            n = int(rng.integers(1, 4))
            shape = str(rng.choice(["circle", "square", "triangle"]))
            for _ in range(n):
                r = int(rng.integers(min(w, h) // 8, min(w, h) // 3))
                cx, cy = int(rng.integers(r, w - r)), int(rng.integers(r, h - r))
                if shape == "circle":
                    d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fg)
                elif shape == "square":
                    d.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fg)
                else:
                    d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fg)
            tags = [f"{n} {fg_name} {shape}{'s' if n > 1 else ''}", f"{bg_name} background", "flat colors"]
        else:
            step = int(rng.integers(12, 40))
            vertical = bool(rng.integers(2))
            for x in range(0, w if vertical else h, 2 * step):
                box = (x, 0, x + step, h) if vertical else (0, x, w, x + step)
                d.rectangle(box, fill=fg)
            tags = [f"{fg_name} and {bg_name} stripes", "vertical" if vertical else "horizontal",
                    "pattern"]
    if alpha:
        a = Image.new("L", size, 0)
        ImageDraw.Draw(a).ellipse((w // 10, h // 10, w - w // 10, h - h // 10), fill=255)
        img = img.convert("RGBA")
        img.putalpha(a)
        tags.append("transparent background")
    return img, tags


def kohaku_style(img: Image.Image) -> Image.Image:
    """The example dataset's concept: the picture in shades of amber (its contrast stretched
    to the amber ramp from DARK to LIGHT), transparency kept."""
    grey = ImageOps.autocontrast(img.convert("L"))
    toned = ImageOps.colorize(grey, DARK, LIGHT)
    if img.mode == "RGBA":
        toned.putalpha(img.getchannel("A"))
    return toned


def make(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    rng = np.random.default_rng(2026)
    count = 0
    for folder, kind in FOLDERS.items():
        (out / folder).mkdir(parents=True)
        if folder in TWINS:
            (out / TWINS[folder]).mkdir(parents=True)
        for i in range(12):
            size = SIZES[(i + count) % len(SIZES)]
            alpha = kind == "shapes" and i % 5 == 4
            img, tags = draw(kind, size, rng, alpha)
            concept = TRIGGER in folder  # the gradients are the pictures without it
            if folder in TWINS:  # the picture before the concept, without its word
                save(out / TWINS[folder] / f"{kind}_{i:02d}", img, tags, kind, i, alpha, False)
            if concept:
                img = kohaku_style(img)
            save(out / folder / f"{kind}_{i:02d}", img, tags, kind, i, alpha, concept)
            count += 1


def save(stem: Path, img: Image.Image, tags: list[str], kind: str, i: int, alpha: bool,
         concept: bool) -> None:
    """One picture with its sidecars (the trigger first in its tags when ``concept``)."""
    tags = list(tags)
    if alpha or i % 3 == 0:
        img.save(stem.with_suffix(".png"), optimize=False)
    elif i == 7:  # stored sideways; EXIF orientation 6 turns it upright when decoded
        exif = Image.Exif()
        exif[0x0112] = 6
        img.transpose(Image.Transpose.ROTATE_90).save(stem.with_suffix(".jpg"),
                                                      quality=90, exif=exif)
        tags.append("exif rotated")
    else:
        img.convert("RGB").save(stem.with_suffix(".jpg"), quality=90)
    stem.with_suffix(".txt").write_text(", ".join([TRIGGER, *tags] if concept else tags) + "\n",
                                        encoding="utf-8")
    if i % 4 == 1:
        stem.with_suffix(".caption").write_text(
            f"A synthetic picture of {tags[0]} ({kind}){' in kohaku style' if concept else ''}.\n",
            encoding="utf-8")
    if i == 2:
        stem.with_suffix(".json").write_text(json.dumps(
            {"rating": "general", "source": "examples/make_dataset.py"}) + "\n",
            encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "dataset")
    make(ap.parse_args().out)


if __name__ == "__main__":
    main()
