from services.router.server import main

main()
