"""Consumers of captures: dataset scans to Parquet (``scan``), the training monitor (``monitor``) and head
labels from aggregated statistics (``head_classes``)."""
