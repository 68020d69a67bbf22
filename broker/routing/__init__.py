"""Routing between sites: which topic filters each site's subscribers hold and who
delivers a shared group's message (`site_interest`, `interest`), their exchange
between sites (`exchange`), and the relay, a shard leader's push of committed
messages to the sites that hold no replica of the shard (`relay`, its bytes in
`relay_wire`). See docs/replication.md, "Every site sees every shard"."""
