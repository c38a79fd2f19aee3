"""One module per report page, named after its notebook: the page's declaration (``@report_page``: title, order,
figures, parameters; `kvscope.harness.analysis.registry` finds every module here), the tables the page shows and
the findings and caveats it opens with. A notebook imports its own page
(``from kvscope.harness.analysis.pages import cost as P``) and `kvscope.harness.analysis.findings`."""
