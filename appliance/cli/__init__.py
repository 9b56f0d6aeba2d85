"""The command-line programs: `nvsharectl` and `nvshare-scheduler`, one module each."""
