"""Reading fleet.yaml: bytes to YAML values that remember their place (`source`, `yamltree`),
the schema's errors as diagnostics (`schema`), the semantic checks (`checks`), the frozen
`Desired` (`config`)."""
