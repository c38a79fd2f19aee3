"""Analysis tables and A/B statistics that the notebooks narrate and plot."""
