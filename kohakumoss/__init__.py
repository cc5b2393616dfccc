"""kohakumoss: finetuning MOSS-Image as a pipeline of cached, content-addressed stages."""

__version__ = "0.1.0"
