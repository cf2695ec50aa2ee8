"""`vlm-engine batch`: folders of images, videos and PDFs into JSON rows (see `run.py`)."""

from vlm_engine.batch.run import BatchOptions, Summary, run_batch

__all__ = ["BatchOptions", "Summary", "run_batch"]
