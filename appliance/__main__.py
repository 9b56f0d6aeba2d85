"""`python -m appliance` runs the node daemon (same as `nvshare-scheduler`)."""

from appliance.cli.nvshare_scheduler import scheduler_main

scheduler_main()
