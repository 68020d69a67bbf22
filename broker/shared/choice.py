"""Which site delivers each message of a shared group: of the sites with members of
the group (each site tells the others its filters, and when it joined), every site
picks the same one for a message (docs/replication.md, "Shared subscriptions across
sites": shared subscriptions work cluster-wide, one delivery per group)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..ds import Message
from ..routing.interest import ShareMember, shared_site
from .groups import SharedGroup


def message_key(message: Message) -> str:
    """What the site that delivers a message to a shared group is chosen by."""
    return f"{message.client_id}|{message.timestamp}"


class SiteChoice:
    """`site` is this site; `members_with` tells the sites holding a `$share/...`
    filter with when each joined (this site too when it does; `SiteInterest` on a
    cluster). Without it, a site alone: this one has every group's messages."""

    def __init__(self, site: str = "",
                 members_with: Callable[[str], Sequence[ShareMember]] | None = None) -> None:
        self.site = site
        self._members_with = members_with

    def members_of(self, group: SharedGroup) -> Sequence[ShareMember]:
        """The sites with members of the group, this one included."""
        if self._members_with is None:
            return [(self.site, 0)]
        return self._members_with(f"$share/{group.key}")

    def delivers_here(self, group: SharedGroup, message: Message) -> bool:
        """Whether this site delivers the message to the group."""
        members = self.members_of(group)
        if len(members) <= 1:
            return True
        return shared_site(group.key, message_key(message), members,
                           message.timestamp) == self.site

    def takes_lost_share(self, group: SharedGroup, message: Message,
                         lost: ShareMember) -> bool:
        """Whether this site delivers, from storage, a message of a site that left
        the group or was forgotten (see replay.py): the lost site was chosen for it,
        and this site is chosen now. Since the choice is a rendezvous hash, no
        message moves between the sites left, so exactly one of them takes it."""
        members = [member for member in self.members_of(group) if member[0] != lost[0]]
        before = shared_site(group.key, message_key(message), [*members, lost],
                             message.timestamp)
        return before == lost[0] and self.delivers_here(group, message)
