"""hivemind's progress tracker, with a clean exit of its event loop. See the package docstring."""

from __future__ import annotations

import asyncio

from hivemind.optim.progress_tracker import ProgressTracker


class LeanHiveProgressTracker(ProgressTracker):
    """ProgressTracker whose thread cancels the helper tasks hivemind leaves pending when it shuts down.

    hivemind's progress fetcher returns on shutdown without cancelling its shutdown-checker and DHT-getter tasks;
    they are destroyed with the loop, and Python prints "Task was destroyed but it is pending!" at exit.
    """

    def run(self):
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        loop.run_until_complete(asyncio.gather(self._progress_reporter(), self._progress_fetcher()))
        self.shutdown_complete.set()
        leftovers = asyncio.all_tasks(loop)
        for task in leftovers:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
        loop.close()
