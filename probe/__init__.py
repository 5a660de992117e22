"""The core: records, capture sessions, selection and storage, frames, the own attention modules."""
