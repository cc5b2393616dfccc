"""`kmoss export` (the stage) and `kmoss export checkpoint PATH` (any step, any file)."""

from __future__ import annotations

from pathlib import Path

import typer

from stages.common import PARAMS_OPTION, console, stage

app = typer.Typer(help="Export adapters and models: ComfyUI, LyCORIS, merged, diffusers.",
                  invoke_without_command=True)


@app.callback()
@stage
def main(
    ctx: typer.Context,
    params: Path = PARAMS_OPTION,
    runs: Path = typer.Option(Path("runs"), help="Runs folder; exports go to runs/<name>/export/."),
) -> None:
    """The export stage: the run's newest checkpoint (export.checkpoint) in export.formats
    (auto: ComfyUI + LyCORIS for an adapter, a merged model for a full finetune)."""
    if ctx.invoked_subcommand is not None:
        return
    from kohakumoss.params import load_params
    from kohakumoss.export.stage import export_run

    for path in export_run(load_params(params), runs):
        console.print(f"wrote {path}")


@app.command("checkpoint")
@stage
def checkpoint(
    path: Path = typer.Argument(..., help="A checkpoint (runs/<name>/checkpoints/step-N) or an "
                                          "adapter file (LyCORIS or ComfyUI) to convert."),
    format: str = typer.Option("comfy", "--format", "-f", help="comfy | lycoris | merged | diffusers"),
    out: Path = typer.Option(None, help="Output file (folder for diffusers); default "
                                        "runs/<name>/exports/ for a checkpoint, beside PATH for a "
                                        "file (see docs/exports.md)."),
    strength: float = typer.Option(1.0, help="Adapter strength merged into merged/diffusers."),
    fused_qkv: bool = typer.Option(True, help="ComfyUI's fused layers.N.proj.qkv layout."),
    style: str = typer.Option("lora_unet", help="ComfyUI key style: lora_unet | diffusion_model."),
    rotations: str = typer.Option("blocks", help="ComfyUI file, OFT/BOFT layers: blocks (compact; "
                                                 "ComfyUI's slider exact at 1 only) | diff (dense: "
                                                 "linear at every strength, much larger)."),
    dtype: str = typer.Option("bf16", help="Saved dtype: bf16 | fp16 | fp32."),
    ema: bool = typer.Option(False, help="Use the checkpoint's EMA weights."),
    model: str = typer.Option(None, "--model", "-m",
                              help="The base model: tiny or a model path (pipeline folder, its "
                                   "transformer/ folder, a .safetensors file). Given, no params "
                                   "file is read; default: the params file's model.transformer."),
    params: Path = PARAMS_OPTION,
) -> None:
    """Re-export any saved step, or convert an adapter file between layouts (onto --model,
    or the params file's model.transformer)."""
    from kohakumoss.params import load_params
    from kohakumoss.export.formats import load_source, write_export
    from kohakumoss.export.stage import default_output

    p = None if model is not None or not params.is_file() else load_params(params)
    src = load_source(p, path, ema=ema, model=model)
    target = out or default_output(src, path, format)
    written = write_export(src, format, target, strength=strength, fused_qkv=fused_qkv, style=style,
                           dtype=dtype, rotations=rotations)
    console.print(f"wrote {written}")


if __name__ == "__main__":
    app()
