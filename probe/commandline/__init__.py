"""What the ``attnprobe`` command needs beyond the public API: models and inputs from the command line
(``loading``) and the modules whose code holds a softmax (``candidates``)."""
