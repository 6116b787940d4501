# The demo project of this repository: the same shape `snakeshard init` gives a user's project,
# with the workflow taken from workflow/ here instead of from the installed package.
import snakeshard

snakeshard.check_config_file("config/config.yaml")  # names the line of a YAML mistake (Snakemake does not)
configfile: "config/config.yaml"


module snakeshard_workflow:
    snakefile:
        "workflow/Snakefile"
    config:
        config


use rule * from snakeshard_workflow
