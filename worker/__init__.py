"""The pagedq service process. Importing this package must stay cheap (no torch): the
`pagedq` console script lives here and its client subcommands never load the engine."""
