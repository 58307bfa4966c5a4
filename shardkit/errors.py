"""The one exception type that the command line turns into a clean exit 2."""


class ShardkitError(ValueError):
    """Bad input from a user: a recipe, an override, a mesh or a model that cannot work.

    The message names the field at fault and what would be valid. The CLI prints it as one line and exits with code 2;
    library users catch it like any ValueError.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")
