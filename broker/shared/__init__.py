"""Shared subscriptions (`$share/{group}/{filter}`): the groups with members on this
site (`groups`), their backlogs read from storage (`backlog`), the share of a site
that left a group or was forgotten (`replay`), and where each group stopped settling
messages, kept in storage (`positions`). See docs/replication.md, "Shared
subscriptions across sites"."""
