"""What ``fp8state demo`` runs (:mod:`.training`) and draws (:mod:`.plot`); private to the CLI."""
