"""The one command line, kvscope; each module adds the subcommands of one stage."""
