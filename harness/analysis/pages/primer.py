"""The primer page (notebooks/primer.ipynb): KV caching, prompt caching and inference economics, taught with the
seed documents' models (`kvscope.harness.primer`); it states no findings about the experiment."""

from __future__ import annotations

from kvscope.harness.analysis.registry import ReportPage, register_page

register_page(ReportPage("primer", "Primer: KV caching, prompt caching and inference economics", order=10,
                         figures=("kv_growth", "speculation_curves")))
