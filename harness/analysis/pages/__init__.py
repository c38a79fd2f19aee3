"""One module per report page, named after its notebook: the tables the page shows and the findings and
caveats it opens with (registered in `kvscope.harness.analysis.registry`). A notebook imports its own page
(``from kvscope.harness.analysis.pages import cost as P``) and `kvscope.harness.analysis.findings`."""
