"""The settings of a Pipeline, torch-free: `PipelineConfig` and its sections (`duplexpipe.config.pipeline`,
`duplexpipe.config.sections`), the option types their fields name and every check they make, so a configuration is
built and checked before torch is imported (`duplexpipe train` refuses a bad flag so). Import each name from its one
home; `duplexpipe.PipelineConfig` and `duplexpipe.train.pipeline_config` re-export them."""
