"""Environment classes the episode tests name in recipes (``env.class: <this file>:Name``), loaded by path as a
user's file is."""


class FollowUp:
    """Two turns: the user asks again after the first answer; reward 1 for an answer that states one."""

    def reset(self, row):
        self.answer = str(row["answer"])
        return None

    def step(self, message):
        if not hasattr(self, "asked"):
            self.asked = True
            return [{"role": "user", "content": "Say it again."}], None, False
        return [], float(f"answer is {self.answer}" in message["content"]), True


class Raises:
    def reset(self, row):
        return None

    def step(self, message):
        raise KeyError("no such state")


class WrongShape:
    def reset(self, row):
        return None

    def step(self, message):
        return "not a tuple"
