"""What a capture becomes: tidy frames (``frames``), captures on disk (``disk``), arguments for bertviz and
circuitsvis (``interop``), token labels (``tokens``) and generation steps stitched into one matrix
(``generation``)."""
