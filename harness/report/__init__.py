"""Notebooks to HTML: the papermill runner, the report index and its sanitising."""
