"""Exports: which source (a training checkpoint or a foreign adapter file) goes onto which base,
in which formats, under which names and manifest (``docs/exports.md``). The files themselves
are read and written by ``kohakumoss.formats`` (``docs/formats.md``)."""
