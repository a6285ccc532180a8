"""The worker lifecycle: the poll loop behind a control socket (base) and the controller that
configures, starts, watches and stops every worker of a trial."""
