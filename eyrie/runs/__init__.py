"""A run as a whole: the pipeline's advance, status, control, --plan's projection, the audit."""
