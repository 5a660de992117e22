"""The Hugging Face adapter's files: the adapter around the registered attention function (``adapter``),
what surrounds one call (``context``), the call's math redone (``recompute``), old-style models through
``output_attentions`` (``fallback``), what a modeling file's source says (``source``), token strings
(``token_strings``), and every transformers internal attnprobe relies on (``compat``)."""
