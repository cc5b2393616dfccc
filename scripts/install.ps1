# Install kohakumoss with the torch build of this machine's NVIDIA driver (scripts/install.py):
#   powershell -ExecutionPolicy Bypass -File scripts\install.ps1 [--dry-run] [--cpu] [--eightbit]
$ErrorActionPreference = "Stop"
Set-Location (Join-Path $PSScriptRoot "..")
$py = if ($env:PYTHON) { $env:PYTHON } else { "python" }
& $py scripts/install.py @args
exit $LASTEXITCODE
